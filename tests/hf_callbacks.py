"""The TrainerCallbacks of tests/test_hf.py, in a module of their own that the tests import
when they run: subclassing TrainerCallback imports transformers' Trainer stack (seconds of
CPU), which an xdist worker that runs none of those tests then never pays for."""

from __future__ import annotations

from transformers import TrainerCallback

from ckptstore.integrations.hf import CkptStoreCallback


class StopAfter(TrainerCallback):
    """Ends training after ``step`` steps, as if the job had been killed there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


class HoldUploads(TrainerCallback):
    """Pauses the store's uploads when training starts; notes what the replica had at each
    step's end; lets them go at the end (or after ``release_s``, so a callback that waits
    for the uploads cannot hang the test)."""

    def __init__(self, cb: CkptStoreCallback, release_s: float) -> None:
        self.cb = cb
        self.release_s = release_s
        self.seen: list[tuple[int, list[int]]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        import threading

        replica = self.cb.manager.replica
        replica.pause()
        threading.Timer(self.release_s, replica.resume).start()

    def on_step_end(self, args, state, control, **kwargs):
        replica = self.cb.manager.replica
        self.seen.append((state.global_step, [s for s in (2, 4, 6) if replica.is_safe(s)]))
        if state.global_step == 6:
            replica.resume()
