"""On CUDA: why the depth synthesis (autofit.estimate.deepen) returns None. Pickles each call's events,
marks and units to $OUT, with the reason found, for offline analysis."""
import os, pickle, sys, traceback
sys.path.insert(0, '.')
import torch
from bench.estimate_accuracy import held_out_models, GLOBAL_BATCH
from autofit.config import Config
from autofit.spec.train import make_spec
from autofit.estimate.estimator import Estimator
import autofit.estimate.deepen as dp

out = os.environ.get("OUT", "/tmp")
calls = []
original = dp.deepen

def deepen(events, marks, units):
    result = original(events, marks, units)
    info = {"bounds": marks.bounds(), "marks": vars(marks).copy(), "units": units, "none": result is None,
            "events": list(events)}
    if marks.bounds() is not None:
        steps = dp._Instances(events, marks.bounds())
        first, second = steps.mallocs[dp.FIRST], steps.mallocs[dp.SECOND]
        info.update(first=[steps.sizes[a] for a in first], second=[steps.sizes[a] for a in second],
                    incoming=[steps.sizes[a] for a in steps.incoming], outgoing=[steps.sizes[a] for a in steps.outgoing])
    calls.append(info)
    print("deepen", units, "bounds", marks.bounds(), "marks", vars(marks), "none", result is None,
          {k: len(v) for k, v in info.items() if isinstance(v, list)}, flush=True)
    return result

dp.deepen = deepen
for name, prec, ckpt, mb in [("gpt2-355m", "fp32", "full", 4), ("gpt2-355m", "fp32", "none", 4), ("qwen2-0.5b", "bf16", "full", 1)]:
    model, batch, seq = held_out_models()[name]
    spec = make_spec(model, batch, seq_len=seq, global_batch_size=GLOBAL_BATCH, device=os.environ.get("DIAG_DEVICE", "cuda"), memory_budget=None if "DIAG_DEVICE" not in os.environ else "1TiB")
    calls.clear()
    try:
        e = Estimator(spec, target="cuda").predict(Config(precision=prec, attention="sdpa", checkpointing=ckpt,
                                                    micro_batch_size=mb, grad_accum_steps=GLOBAL_BATCH // mb))
        print(name, prec, ckpt, mb, e.peak_bytes / 2**20, e.terms, flush=True)
    except Exception:
        traceback.print_exc()
    with open(f"{out}/deepen-{name}-{prec}-{ckpt}-{mb}.pkl", "wb") as f:
        pickle.dump(calls, f)
print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))
