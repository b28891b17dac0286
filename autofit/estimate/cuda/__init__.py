"""What a CUDA card holds that a CPU simulation does not show by itself: attention, dropout and autocast as
CUDA runs them (`attention`, `dropout`, `autocast`), and the caching allocator replayed over the simulated
step (`allocator`) with the training around it (`training_replay`).
"""
