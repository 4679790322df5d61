"""What rank 0 shows a person: a progress bar during training, a summary table after, and
the library's warnings as plait lines."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from plait.checkpoint import CheckpointWarning
from plait.throughput import tokens_per_second
from plait.train.stragglers import straggler_text


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass
class Gauges:
    """What the step log shows beside the loss: memory and the model FLOPs' rate (MFU
    where the device's peak is known), from numbers the CLI layer supplies."""

    flops_per_token: float = 0.0  # model FLOPs per trained token (no recompute)
    ranks: int = 1
    peak_flops: float | None = None  # one rank's device, dense bf16 (None: unknown)
    memory: Callable[[], tuple[int, str]] | None = None  # (bytes, what they are)

    def text(self, tokens_per_s: float) -> str:
        parts = []
        if self.memory is not None:
            used, what = self.memory()
            parts.append(f"mem {human_bytes(used)} ({what})")
        per_rank = self.flops_per_token * tokens_per_s / max(self.ranks, 1)
        if self.flops_per_token and self.peak_flops:
            parts.append(f"MFU {per_rank / self.peak_flops:.1%}")
        elif self.flops_per_token:  # a CPU: no peak to divide by
            parts.append(f"{per_rank / 1e9:,.2f} GFLOP/s/rank")
        return "  ".join(parts)


@contextlib.contextmanager
def progress_reporter(total_steps: int, enabled: bool, gauges: Gauges | None = None,
                      every: int | None = None) -> Iterator[Callable[[dict], None]]:
    """Yields show(row): advances a rich progress bar with the step's loss and speed, and
    prints a step line every `every` steps (default: about ten a run), the last, and each
    step with a validation loss. Its tokens/s is the summary's (plait/throughput.py: the
    steps so far, the first left out once there are others), so the bar's last value is
    the summary's."""
    if not enabled:
        yield lambda row: None
        return
    gauges = gauges or Gauges()
    progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/"
                        "{task.total}"), TextColumn("{task.description}"), TimeRemainingColumn(),
                        console=Console(stderr=True))
    times: list[float] = []
    named: set[int] = set()  # the stragglers already announced
    with progress:
        task = progress.add_task("", total=total_steps)
        every = every or max(total_steps // 10, 1)

        def show(row: dict) -> None:
            times.append(row["step_time"])
            rate = tokens_per_second(row["tokens"], times)
            if (row["step"] % every == 0 or row["step"] == total_steps - 1
                    or "val_loss" in row):
                # stdout, beside the summary (the live bar, on stderr, shows it above itself)
                print(f"step {row['step']:>5}  loss {row['loss']:.4f}  "
                      f"grad norm {row['grad_norm']:.3f}  {rate:,.0f} tokens/s  "
                      f"{gauges.text(rate)}{_moe_note(row)}{_straggler_note(row)}"
                      f"{_validation_note(row)}".rstrip(),
                      flush=True)
            verdict = row.get("straggler")
            if verdict and verdict["rank"] not in named:  # once a rank, when first named
                named.add(verdict["rank"])
                print(f"plait: straggler at step {verdict['step']}: {straggler_text(verdict)}",
                      flush=True)
            progress.update(task, advance=1, description=(
                f"loss {row['loss']:.4f}  {rate:,.0f} tokens/s  lr {row['lr']:.2e}"
                f"{_straggler_note(row)}"))

        yield show


def _validation_note(row: dict) -> str:
    """The held-out loss after this step, where one was computed (train.eval_every)."""
    if "val_loss" not in row:
        return ""
    return f"  val loss {row['val_loss']:.4f}  val ppl {row['val_perplexity']:.2f}"


def _moe_note(row: dict) -> str:
    """An MoE step's routing: balance loss, the worst layer's max / mean expert load and
    dropped assignments (plait/parallel/expert.py, finish_moe_step)."""
    moe = row.get("moe")
    if not moe:
        return ""
    return (f"  aux {moe['aux_loss']:.4f}  expert load max/mean "
            f"{moe['load_max_over_mean']:.2f}  dropped {moe['dropped_tokens']}")


def _straggler_note(row: dict) -> str:
    """The step's straggler (plait/train/stragglers.py), where one is named."""
    verdict = row.get("straggler")
    if not verdict:
        return ""
    return (f"  straggler rank {verdict['rank']} (node {verdict['node']}) "
            f"{verdict['slower_by']:.2f}x")


def stragglers_field(summary: dict) -> str | None:
    """The summary's stragglers in one line: those named, or that none was."""
    found = summary.get("stragglers")
    if not found or len(found["compute_s_per_rank"]) < 2:
        return None
    if not found["named"]:
        return "none named"
    return "; ".join(f"{straggler_text(v)} (from step {v['first_step']})"
                     for v in found["named"])


def _params(summary: dict) -> str:
    total, local = summary["param_count"], summary.get("param_count_local")
    if local is None or local == total:
        return f"{total:,}"
    return f"{total:,} (rank 0 holds {local:,})"


def compile_note(backend: str) -> str:
    """What the first step of a --compile run is doing, said before it starts."""
    return (f"plait: compiling each transformer block (torch.compile, {backend}) during the "
            "first step: it takes far longer than the others (a minute or more on a CPU)")


def steps_done_text(done: int, total: int) -> str:
    """How far a run got, numbered as the step lines number steps (from 0): 'after step
    56 (57 of 150 steps done)', or 'before step 0 (none of 150 steps done)'."""
    if done <= 0:
        return f"before step 0 (none of {total} steps done)"
    return f"after step {done - 1} ({done} of {total} steps done)"


def final_line(summary: dict, metrics: list[dict], metrics_path: object = None) -> str:
    """The one line every run ends with, --quiet or not."""
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    where = f"; metrics in {metrics_path}" if metrics_path else ""
    layout = summary["layout"].split(" (")[0]  # the sizes, without the order note
    restarts = summary.get("restarts")  # plait train --max-restarts (plait/launch/elastic.py)
    after = (f" (the last attempt, after {restarts} restart{'s' * (restarts > 1)}, "
             f"{summary['lost_steps']} steps lost)" if restarts else "")
    val = f" (val {summary['val_loss']:.4f})" if "val_loss" in summary else ""
    return (f"plait: done: {summary['steps']} steps on {layout}{after}, loss {first:.4f} "
            f"-> {last:.4f}{val}, {summary['tokens_per_s']:,.0f} tokens/s{where}")


def print_summary(summary: dict, metrics: list[dict], console: Console | None = None,
                  gauges: Gauges | None = None) -> None:
    console = console or Console()
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    fields = [("layout", summary["layout"]), ("params", _params(summary)),
              ("loss", f"{first:.4f} -> {last:.4f}"),
              *([("val loss", f"{summary['val_loss']:.4f} (perplexity "
                  f"{summary['val_perplexity']:.2f}, after the last step)")]
                if "val_loss" in summary else []),
              # plait/throughput.py: global batch tokens / step time, first step left out
              ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
              ("step", f"{summary['mean_step_time'] * 1e3:.1f} ms")]
    if "optimizer" in summary:  # Muon: which parameters it takes (plait/muon.py's rule)
        fields.append(("optimizer", summary["optimizer"]))
    if gauges is not None and summary["tokens_per_s"]:
        fields.append(("rank 0", gauges.text(summary["tokens_per_s"])))
    if metrics and metrics[-1].get("moe"):  # routing of the last step
        fields.append(("experts", _moe_note(metrics[-1]).strip()))
    if (stragglers := stragglers_field(summary)) is not None:
        fields.append(("straggler", stragglers))
    for name, value in fields:  # one field a line: a narrow terminal never splits one
        console.print(f"[bold]{name:<9}[/] {value}", soft_wrap=True, highlight=False)
    table = Table(title="communication per step, rank 0 (ring-algorithm bytes)")
    for col in ("collective", "dim", "calls", "payload", "sent", "received", "time"):
        table.add_column(col, justify="left" if col in ("collective", "dim") else "right")
    ledger = summary["ledger"]
    for key, row in sorted(ledger["per_step"].items()):
        op, dim = key.split("@")
        table.add_row(op, dim, f"{row['count']:.0f}", human_bytes(row["payload"]),
                      human_bytes(row["sent"]), human_bytes(row["received"]),
                      f"{row['seconds'] * 1e3:.1f} ms")
    table.add_row("total", "", "", "", human_bytes(ledger["sent_bytes_per_step"]),
                  human_bytes(ledger["received_bytes_per_step"]),
                  f"{ledger['comm_seconds_per_step'] * 1e3:.1f} ms")
    console.print(table)
    overlap = ledger.get("overlap_per_step", {})
    if overlap:  # time is issue to completion; exposed is what the rank waited for
        console.print("exposed (rank waited) / hidden (in flight behind work), per step: "
                      + ", ".join(f"{d} {r['exposed'] * 1e3:.1f} / {r['hidden'] * 1e3:.1f} ms"
                                  for d, r in sorted(overlap.items())),
                      soft_wrap=True, highlight=False)


@contextlib.contextmanager
def plait_warnings(lead: bool) -> Iterator[None]:
    """A checkpoint warning (one skipped as corrupt, settings changed since the save) as
    one `plait: warning:` line from rank 0, not Python's file:line form from every rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("default" if lead else "ignore", CheckpointWarning)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if issubclass(category, CheckpointWarning):
                print(f"plait: warning: {message}", file=sys.stderr, flush=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield
