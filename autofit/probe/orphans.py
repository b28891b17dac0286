"""Processes whose launcher is gone: a probe's ranks and the dry-run's simulation workers exit, and take
the launcher's job folder with them, when the process that started them was killed before it could.

Kept apart from `autofit.probe.child`, the probe's entry point (`python -m autofit.probe.child`): the
launcher imports these names, and a module run with -m that was already imported through the package
(autofit imports the launcher) is run twice, with runpy's warning on every rank's stderr.
"""

from __future__ import annotations

import os

LAUNCHER_PID = "AUTOFIT_LAUNCHER_PID"  # set by the launcher: the process whose death ends this one
JOB_FOLDER_PREFIX = "autofit-probe-"  # the probe launcher's temporary folder for a job


def leave_with_parent(job_path: str, folder_prefix: str, poll: float = 1.0) -> None:
    """Exit when the launching process (`LAUNCHER_PID` in the environment) is gone, killed before it could
    reap this one: a probe runs in its own session so that the launcher's kill reaches what it starts, so
    no signal would reach it. The launcher's job folder (named `folder_prefix...`) goes too, as its own
    exit would have removed it: the job holds the serialised model (a module given as an instance travels
    with its weights). Simulation workers (`autofit.estimate.simulation.workers`) leave the same way. A probe
    forked by the warm process (`autofit.probe.zygote`) has that process as its launcher here; the warm
    process watches the real one, and kills its probes and removes their folders when it is gone."""
    import threading
    import time

    parent = int(os.environ.get(LAUNCHER_PID, os.getppid()))  # the launcher's own word: it may be gone already

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
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
