"""`plait report --html FILE`: one self-contained page of a run, and `--png-dir DIR`, its
pictures as files.

The page needs nothing but itself: the style is inline, every picture a base64 PNG
(`data:` URI) drawn by plait/observe/figures.py, no script, no font or stylesheet from
anywhere. Its data is `plait report`'s (plait/observe/report.py, `compare`): the
configuration and layout from the summary line, the loss and throughput curves from the
step rows, memory by category and communication per mesh dim, planner beside
measurement, overlap, and the pipeline's bubble and timeline. A section it cannot fill
says why (no plan: no configuration recorded; no memory step; pp = 1).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from plait.files import atomic_output
from plait.observe.figures import FIGURES, bubbles

SECTIONS = ("run", "curves", "memory", "communication", "overlap", "pipeline", "notes")
STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1000px; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
.why { color: #8a5a00; background: #fff8e6; padding: 0.4em 0.8em; border-left: 3px solid #f5a623; }
.configs { display: flex; gap: 1.5em; flex-wrap: wrap; align-items: flex-start; }
"""


def _bytes(n: float | None) -> str:
    from plait.train.progress import human_bytes

    return "-" if n is None else human_bytes(n)


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(pngs: dict[str, bytes], name: str) -> str:
    data = base64.b64encode(pngs[name]).decode("ascii")
    return f'<img alt="{name}" src="data:image/png;base64,{data}">'


def _why(text: str) -> str:
    return f'<p class="why">{html.escape(text)}</p>'


def _run_section(rows: list[dict], summary: dict, config: dict | None) -> str:
    facts = [["layout", summary.get("layout", "-")], ["world size", summary.get("world_size", "-")],
             ["steps", len(rows)],
             ["loss", f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}"],
             *([["validation loss after the last step (perplexity)",
                 f"{summary['val_loss']:.4f} ({summary['val_perplexity']:.2f})"]]
               if "val_loss" in summary else []),
             ["tokens/s (first step left out)", _num(summary.get("tokens_per_s"), ",.0f")],
             ["mean step time, ms", _num((summary.get("mean_step_time") or 0) * 1e3, ".1f")],
             ["parameters: the model's (rank 0's)", f"{_count(summary.get('param_count'))} "
              f"({_count(summary.get('param_count_local'))})"]]
    out = _table(["run", ""], facts)
    if config is None:
        return out + _why("the metrics file records no configuration")
    tables = [_table([section, ""], [[k, v] for k, v in config[section].items()])
              for section in ("model", "parallel", "train") if section in config]
    name = html.escape(str(config.get("model_name", "custom")))
    return out + f"<p>model preset: {name}</p><div class=configs>{''.join(tables)}</div>"


def _memory_section(rep: dict | None, pngs: dict, why: dict) -> str:
    if rep is None or not rep.get("memory"):
        return _why(why["memory"])
    m = rep["memory"]
    rows = [[c["category"], _bytes(c["predicted"]), _bytes(c["measured"]), _num(c["ratio"])]
            for c in m["categories"]]
    return (f"<p>rank 0, step {m['step']}: the planner (kernels=eager) beside the tracker's "
            f"measured peak; predicted peak moment: {html.escape(str(m['moment']))}</p>"
            + _table(["category", "predicted", "measured", "predicted / measured"], rows)
            + _img(pngs, "memory"))


def _communication_section(rep: dict | None, pngs: dict, why: dict) -> str:
    if rep is None:
        return _why(why["communication"])
    rows = [[d["dim"], ", ".join(f"{x['op']} x{x['calls']:g}" for x in d["predicted"]) or "-",
             _bytes(d["predicted_bytes"] or None),
             ", ".join(f"{x['op']} x{x['calls']:g}" for x in d["measured"]) or "-",
             _bytes(d["measured_bytes"] or None), _num(d["ratio"])]
            for d in rep["communication"]]
    figure = _img(pngs, "communication") if "communication" in pngs else _why(
        why["communication"])
    return ("<p>payload bytes per step, rank 0: the planner's collectives beside the "
            "ledger's</p>" + _table(["dim", "planner: op x calls", "predicted",
                                     "ledger: op x calls", "measured", "ratio"], rows) + figure)


def _overlap_section(rep: dict | None, pngs: dict, why: dict) -> str:
    if rep is None or "overlap" not in pngs:
        return _why(why["overlap"])
    from plait.observe.report import OVERLAP_COLUMNS, overlap_rows, overlap_title

    step = rep.get("step_time_s")
    return (f"<p>{html.escape(overlap_title(step))}</p>"
            + _table(list(OVERLAP_COLUMNS), overlap_rows(rep["communication"], step))
            + _img(pngs, "overlap"))


def _pipeline_section(summary: dict, pngs: dict, why: dict) -> str:
    p = summary.get("pipeline")
    if not p:
        return _why(why["bubble"])
    rows = [[name, f"{100 * value:.1f} %"] for name, value in bubbles(summary)]
    idle = [[k, f"{100 * v:.1f} %"] for k, v in p.get("idle", {}).items()]
    timeline = (_img(pngs, "timeline") if "timeline" in pngs else _why(why["timeline"]))
    return (f"<p>{html.escape(str(p['schedule']))} pp={p['pp']} m={p['microbatches']} "
            f"v={p['virtual_stages']}: {html.escape(str(p.get('partition', '')))}</p>"
            + _table(["bubble", ""], rows) + _img(pngs, "bubble")
            + _table(["measured idle", "share"], idle)
            + "<p>the last step's measured timeline, a row per rank</p>" + timeline)


def render_html(rows: list[dict], summary: dict, config: dict | None, rep: dict | None,
                pngs: dict[str, bytes], why: dict[str, str], title: str) -> str:
    """The page as one string (every figure inside it)."""
    notes = (rep or {}).get("notes", []) or [why.get("memory", "")]
    body = {
        "run": ("Configuration and layout", _run_section(rows, summary, config)),
        "curves": ("Loss and throughput", _img(pngs, "loss") + _img(pngs, "throughput")),
        "memory": ("Memory: predicted vs measured", _memory_section(rep, pngs, why)),
        "communication": ("Communication: planner vs ledger",
                          _communication_section(rep, pngs, why)),
        "overlap": ("Overlap", _overlap_section(rep, pngs, why)),
        "pipeline": ("Pipeline: bubble and timeline", _pipeline_section(summary, pngs, why)),
        "notes": ("Notes", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes)
                  + "</ul>"),
    }
    sections = "".join(f'<section id="{key}"><h2>{body[key][0]}</h2>{body[key][1]}</section>'
                       for key in SECTIONS)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>'
            f"{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{sections}</body></html>\n")


def write_pngs(pngs: dict[str, bytes], directory: str | Path) -> list[Path]:
    """Each figure as DIR/NAME.png, each written whole or not at all."""
    paths = []
    for name in FIGURES:
        if name in pngs:
            path = Path(directory).expanduser() / f"{name}.png"
            with atomic_output(path) as tmp:
                tmp.write_bytes(pngs[name])
            paths.append(path)
    return paths


def write_html(page: str, path: str | Path) -> Path:
    """The page, UTF-8 as its meta tag says, whole or not at all."""
    with atomic_output(path) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return Path(path).expanduser()
