"""The overlapped F&B executor: a forward and a backward of different micro-batches
(DualPipe's F&B pair, `ir.fb_pairs`) run interleaved, so that one's expert all-to-alls
travel while the other computes (DeepSeek-V3 technical report, section 3.2.1, Figure 4).

How. The pair's two sides run on two threads, exactly one of them at a time: a baton
passes between them at the all-to-alls. A side issues its all-to-all async (through the
ledger, plait/comm/ops.py) and hands the baton over; the other side computes its next
pieces (attention, experts, their backward) until its own all-to-all is issued, then
hands it back; the first side then waits for its transfer, which has run under the other
side's compute. So the pieces interleave in the order the model reaches its all-to-alls:
forward attention and dispatch, backward combine, forward experts and combine, backward
experts and dispatch, and so on, layer by layer; the ledger's `blocked` time of each
all-to-all is what the overlap did not hide.

Why threads and one baton: the model's forward and autograd's backward are ordinary
code with no place to yield but the collectives; the baton makes the interleaving, and so
the order in which every rank issues its collectives, a function of the program alone
(every rank of an expert group runs the same pairs), which collectives need. A side with
no all-to-all (a dense stage) runs whole, then the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch
from torch import nn

from plait.comm.autograd import OverlapSeam
from plait.comm.ops import Handle

_SIDES = ("F", "B")


class FBPair:
    """Runs paired forward and backward callables interleaved (see the module docstring)
    through the all-to-all seams of `stages`' MoE blocks."""

    def __init__(self, stages: Iterable[nn.Module], device: torch.device):
        self.seams = [seam for stage in stages for m in stage.modules()
                      if isinstance(seam := getattr(getattr(m, "dispatch", None), "seam",
                                                    None), OverlapSeam)]
        self.device = device
        self._cv = threading.Condition()
        self._turn, self._running = "F", {"F": False, "B": False}

    def run(self, forward: Callable[[], object], backward: Callable[[], object]
            ) -> tuple[object, object]:
        """forward() on this thread, backward() on a helper, the baton starting with the
        forward; their results. An error on either side is raised here: once both ended,
        or at once when the forward failed (its backward side is not waited for)."""
        out: dict[str, object] = {}
        errors: list[BaseException] = []
        self._turn, self._running = "F", {"F": True, "B": True}
        helper = threading.Thread(target=self._side, args=("B", backward, out, errors),
                                  name="fb-pair-backward", daemon=True)
        for seam in self.seams:
            seam.wait = self._wait
        try:
            helper.start()
            self._side("F", forward, out, errors)
            if not errors:  # a failed forward raises at once: its backward side may be
                helper.join()  # blocked in a collective the failure left unmatched (daemon)
        finally:
            for seam in self.seams:
                seam.wait = None
        if errors:
            raise errors[0]
        return out["F"], out["B"]

    def _side(self, side: str, fn: Callable[[], object], out: dict[str, object],
              errors: list[BaseException]) -> None:
        if side == "B" and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        with self._cv:
            self._cv.wait_for(lambda: self._turn == side)
        try:
            out[side] = fn()
        except BaseException as e:  # raised on the caller's thread by `run`
            errors.append(e)
        finally:
            with self._cv:
                self._running[side] = False
                self._turn = _other(side)
                self._cv.notify_all()

    def _wait(self, handle: Handle, backward: bool) -> None:
        """The seam's wait: let the other side compute while `handle` is in flight (if it
        has not ended), then complete it."""
        side = "B" if backward else "F"
        with self._cv:
            if self._running[_other(side)]:
                self._turn = _other(side)
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == side)
        handle.wait()


def _other(side: str) -> str:
    return _SIDES[1 - _SIDES.index(side)]
