"""Processes whose launcher is gone: a probe's ranks and the dry-run's simulation workers exit (the workers
taking the folder they share with the caller) when the process that started them was killed before it could.
And how a process of autofit's ends once its work is done (`exit_process`).

Kept apart from `autofit.probe.child`, the probe's entry point (`python -m autofit.probe.child`): the
launcher imports these names, and a module run with -m that was already imported through the package
(autofit imports the launcher) is run twice, with runpy's warning on every rank's stderr.
"""

from __future__ import annotations

import os

LAUNCHER_PID = "AUTOFIT_LAUNCHER_PID"  # set by the launcher: the process whose death ends this one


def exit_process(code: int, forked: bool = False) -> None:
    """End this process as an interpreter's exit would -- its exit handlers run, Python's buffered output and C's
    written, `code` -- but without tearing the interpreter down module by module: after torch and transformers'
    modeling are imported that alone takes about a second (`import transformers.models.llama.modeling_llama`:
    5.6 s, 4.4 s ending this way). For a process whose work is done. Where a thread other than the main one still
    runs (not a daemon), Python's own exit is taken: it waits for that thread. `forked`: a process forked from
    another (a warm process's probe), which must never run its parent's finalizers and whose C buffers may hold
    what its parent had not written yet: it ends here whatever runs, its C buffers left unwritten."""
    import atexit
    import sys
    import threading

    if not forked and any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
                          if thread is not threading.main_thread()):
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream has nothing left to write
                pass
        try:
            if not forked:
                import ctypes

                ctypes.CDLL(None).fflush(None)  # what C libraries wrote to a piped stdout and left in its buffer
        except Exception:  # noqa: BLE001, S110 - no C library to ask (not POSIX): nothing buffered there
            pass
        os._exit(code)


def leave_with_parent(job_path: str | None = None, folder_prefix: str = "", poll: float = 1.0) -> None:
    """Exit when the launching process (`LAUNCHER_PID` in the environment) is gone, killed before it could
    reap this one: a probe runs in its own session so that the launcher's kill reaches what it starts, so
    no signal would reach it. Where the launcher shares a folder with it (`job_path` names a file in a folder
    named `folder_prefix...`: the simulation workers', `autofit.estimate.simulation.workers`), the folder goes
    too, as the launcher's own exit would have removed it. A probe forked by the warm process
    (`autofit.probe.zygote`) has that process as its launcher here; the warm process watches the real one,
    and kills its probes when it is gone."""
    import threading
    import time

    parent = int(os.environ.get(LAUNCHER_PID, os.getppid()))  # the launcher's own word: it may be gone already

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        if job_path is not None:
            remove_job_folder(job_path, folder_prefix)
        os._exit(1)

    threading.Thread(target=watch, name="autofit-parent-watch", daemon=True).start()


def remove_job_folder(job_path: str, folder_prefix: str) -> None:
    """Remove the temporary folder the launcher made for this job (each rank or worker may try: the first
    wins); a job file elsewhere, as one run by hand, is left alone."""
    import shutil
    from pathlib import Path

    folder = Path(job_path).resolve().parent
    if folder.name.startswith(folder_prefix):
        shutil.rmtree(folder, ignore_errors=True)
