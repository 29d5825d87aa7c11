"""Joins the cells of a benchmark family (`Family.cells`, one `compare.py` run each) into the
family's one results file set, bench/results/FAMILY.{md,json}.

Per cell it says: ours without a pipeline against the compute-only bound (how much of the step
is exposed communication), the best pipelined mode and how much of that exposure it hides,
whether auto chose within 5% of the best, TorchRec's time in units of ours, and, from worker
0's profile of every mode (bench/step_stages.py), the stage times and what the step waits on.
What bounds the best mode: the link where its bytes fill its step; its own CPU work where its
process keeps its cores about as busy as the compute-only bound does (nothing left to hide); the
exchanges after its last backward where the step is about its compute plus their time on the link
(`in_step_bound_ms`); else its largest wait.
"""
import json
import os
import re
import time

from runner import HERE

RESULTS = os.path.join(HERE, "results")
# The targets, judged where none exposes at least EXPOSED_MIN of its step.
EXPOSED_MIN = 0.25
BEST_VS_NONE = 0.85
BEST_VS_BOUND = 1.15
AUTO_VS_BEST = 1.05
TORCHREC_RATIO = 1.2
# A mode whose process keeps its cores at least this share as busy as the compute-only bound's
# is bounded by its own CPU work, not by an exchange it waits on.
CPU_BOUND_BUSY = 0.85
# A mode whose bytes take at least this share of its step on the link at its rate is bounded by
# the link: only fewer bytes (compression, fewer distinct ids) make it faster, no overlap.
WIRE_BOUND_SHARE = 0.8
# The exchanges after the last backward bound a mode whose step is within BEST_VS_BOUND of its
# in-step bound where they take at least this share of the step on the link.
AFTER_BACKWARD_SHARE = 0.1
# The share of an emulated link's rate that carries the bytes we send: a full TCP segment holds
# 1448 bytes (1500 MTU less the IP and TCP headers with timestamps) in a 1514-byte Ethernet
# frame, and `tc tbf` counts frames.
LINK_PAYLOAD_SHARE = 1448 / 1514
PIPELINED = ("dbp", "fwp", "nested")
STAGE_COLUMNS = ("route", "rows", "dense_forward", "dense_backward", "embedding_backward",
                 "optimizer", "other")
WAIT_COLUMNS = ("keys_exchange", "rows_exchange", "gradient_exchange", "dense_allreduce",
                "other")


def cell_output(family, cell):
    """The output name of one cell's `compare.py` run (joined, then removed)."""
    return "%s--%s" % (family, cell)


def _ours(rows, pipeline):
    found = [r for r in rows if r["system"] == "nestpipe" and r["pipeline"] == pipeline
             and r.get("ms_median")]
    return found[0] if found else None


def _system(rows, system):
    found = [r for r in rows if r["system"] == system and r.get("ms_median")]
    return found[0] if found else None


def _ms(row):
    return row["ms_median"] if row else None


def _fmt(value, pattern="%.1f"):
    return "-" if value is None else pattern % value


def _ratio(row, base):
    """Row over base, paired by round where both have rounds (else the medians' ratio)."""
    if not row or not base:
        return None
    a, b = row.get("ms_rounds") or [], base.get("ms_rounds") or []
    if len(a) == len(b) >= 2:
        ratios = sorted(x / y for x, y in zip(a, b))
        mid = len(ratios) // 2
        return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return row["ms_median"] / base["ms_median"]


def largest_wait(row):
    """(exchange, ms) of the largest wait in a row's profile, or None."""
    waits = (row or {}).get("stages", {}).get("wait_ms")
    if not waits:
        return None
    name = max(waits, key=waits.get)
    return name, waits[name]


def summarize_cell(rows):
    """The cell's verdicts: a dict of the numbers the summary table shows."""
    none, bound = _ours(rows, "none"), _system(rows, "compute_only")
    auto = _ours(rows, "auto")
    modes = {p: _ours(rows, p) for p in PIPELINED}
    ratios = {p: _ratio(r, none) for p, r in modes.items() if r}
    best = min(ratios, key=ratios.get) if ratios else None
    out = {"none_ms": _ms(none), "bound_ms": _ms(bound), "best": best,
           "best_vs_none": ratios.get(best), "vs_none": ratios,
           "auto_vs_none": _ratio(auto, none), "auto_choice": (auto or {}).get("auto_choice"),
           "auto_probe_s": (auto or {}).get("auto_probe_extra_s")}
    if none and bound:
        out["exposed_share"] = 1.0 - _ratio(bound, none)
    if best and bound:
        out["best_vs_bound"] = modes[best]["ms_median"] / bound["ms_median"]
    if best:
        out["wire_bound_ms"] = wire_bound_ms(modes[best])
    if out.get("wire_bound_ms") and bound:
        # No overlap makes the step shorter than its bytes' time on the link.
        out["link_vs_bound"] = out["wire_bound_ms"] / bound["ms_median"]
    if best and bound:
        out["in_step_bound_ms"] = in_step_bound_ms(modes[best], bound)
    if out.get("in_step_bound_ms"):
        out["best_vs_in_step"] = modes[best]["ms_median"] / out["in_step_bound_ms"]
    if best:
        out["hidden"] = hidden_share(modes[best], none, bound)
    if auto and best:
        # auto's time over the best of none and the pipelines (auto may rightly pick none)
        floor = min([1.0] + list(ratios.values()))
        out["auto_vs_best"] = out["auto_vs_none"] / floor if out["auto_vs_none"] else None
    ours_best = min([r["ms_median"] for r in [none] + list(modes.values()) if r] or [None]) \
        if none else None
    for system in ("torchrec", "torchrec_pipelined"):
        peer = _system(rows, system)
        if peer and ours_best:
            out[system + "_vs_ours"] = peer["ms_median"] / ours_best
    out["bounding"] = bounding_text(modes.get(best), bound) if best else None
    out["none_bounding"] = bounding_text(none, bound)
    return out


def link_bytes_per_second(network):
    """The rate of an emulated link "DELAYms:RATE" (RATE like 200mbit, 1gbit, 2500mbit) in
    bytes per second; None for loopback or an unknown spelling."""
    match = re.fullmatch(r"[\d.]+ms:([\d.]+)(k|m|g)bit", network or "")
    if not match:
        return None
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)] / 8


def _link_ms(row, sent_bytes):
    """The time `sent_bytes` take on `row`'s link at its rate, in TCP frames; None for
    loopback."""
    rate = link_bytes_per_second((row or {}).get("network"))
    return 1e3 * sent_bytes / (rate * LINK_PAYLOAD_SHARE) if rate else None


def _dense_sent(row):
    """Worker 0's share of the dense all-reduce, a reduce-scatter and an all-gather: 2 (W - 1)
    / W of the dense weights' bytes."""
    workers = row.get("workers") or 2
    return (row.get("dense_bytes") or 0) * 2 * (workers - 1) / workers


def wire_bound_ms(row):
    """The least time a step of `row` spends on its link: the bytes worker 0 sends per step
    (its embedding exchanges, as the wire counters count them, and its share of the dense
    all-reduce) over the share of the link's rate that carries them (`LINK_PAYLOAD_SHARE`);
    None where unknown. No overlap makes a step shorter than this."""
    sent = (row or {}).get("wire_bytes_per_step")
    if not sent:
        return None
    return _link_ms(row, sum(sent.values()) + _dense_sent(row))


def after_backward_ms(row):
    """The least time the exchanges that follow a step's last backward take on `row`'s link:
    worker 0's row gradients (the wire counters' "backward") and its share of the dense
    all-reduce; None where unknown."""
    sent = (row or {}).get("wire_bytes_per_step")
    if not sent or "backward" not in sent:
        return None
    return _link_ms(row, sent["backward"] + _dense_sent(row))


def in_step_bound_ms(row, bound):
    """The fastest a step of `row` can be while it applies its own update before it ends (every
    mode does: the tables are current whenever control returns between steps): the compute
    (the compute-only bound's step), then the exchanges after the last backward, which nothing
    of the same step is left to overlap; or all its bytes' time on the link, if longer. None
    where unknown."""
    after = after_backward_ms(row)
    if after is None or not bound:
        return None
    return max(bound["ms_median"] + after, wire_bound_ms(row) or 0.0)


def bounding_text(row, bound):
    """What bounds `row`'s step: the link where its bytes fill most of the step at the link's
    rate (`WIRE_BOUND_SHARE`); else its own CPU work where its process keeps its cores about as
    busy as the compute-only bound keeps them (`CPU_BOUND_BUSY` of it: waiting cannot be what
    is left); else the exchange it waits on most (worker 0's profile); None if unknown."""
    if not row:
        return None
    wait = largest_wait(row)
    busy, reference = row.get("cpu_busy"), (bound or {}).get("cpu_busy")
    wire = wire_bound_ms(row)
    if wire is not None and wire >= WIRE_BOUND_SHARE * row["ms_median"]:
        return "the link: %.1f ms/step of its bytes in TCP frames (%.0f%% of the step)" % (
            wire, 100 * wire / row["ms_median"])
    if busy and reference and busy >= CPU_BOUND_BUSY * reference:
        text = "its own CPU: %.1f ms/step%s, %.2f cores busy (compute-only: %.1f ms%s, %.2f)" % (
            row["cpu_ms_per_step"], _kernel(row), busy, bound["cpu_ms_per_step"], _kernel(bound),
            reference)
        return text + ("; largest wait %s %.1f ms" % wait if wait else "")
    after, in_step = after_backward_ms(row), in_step_bound_ms(row, bound)
    if (in_step and after >= AFTER_BACKWARD_SHARE * row["ms_median"]
            and row["ms_median"] <= BEST_VS_BOUND * in_step):
        return ("the exchanges after its last backward: %.1f ms of gradient bytes on the link, "
                "which nothing of its step overlaps (compute-only + them: %.1f ms, the step "
                "%.2fx of it)" % (after, in_step, row["ms_median"] / in_step))
    return "waits on %s %.1f ms" % wait if wait else None


def _kernel(row):
    """`row`'s kernel share of its process CPU, e.g. " (4.1 in the kernel)", or "" if unknown."""
    kernel = row.get("cpu_sys_ms_per_step")
    return " (%.1f in the kernel)" % kernel if kernel is not None else ""


def _verdict(value, limit, below=True):
    if value is None:
        return "-"
    met = value <= limit if below else value >= limit
    return "%.2fx %s" % (value, "met" if met else "**missed**")


def summary_lines(cells):
    """The family's summary table (one line per cell) and the targets."""
    lines = ["| cell | none ms | compute-only ms | exposed share of none | best pipelined "
             "(vs none) | best vs compute-only | best vs in-step bound (ms) "
             "| exposure hidden by best | auto (vs best) "
             "| TorchRec / ours' best: plain, pipelined | best mode's bytes on the link "
             "(ms/step at its rate, in TCP frames) | what bounds the best mode |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, summary in cells:
        judged = (summary.get("exposed_share") or 0) >= EXPOSED_MIN
        best = summary.get("best")
        bounding = summary.get("bounding")
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s, %s | %s | %s |" % (
            name, _fmt(summary.get("none_ms")), _fmt(summary.get("bound_ms")),
            _fmt(summary.get("exposed_share"), "%.2f"),
            "%s %s" % (best, _verdict(summary.get("best_vs_none"), BEST_VS_NONE)
                       if judged else _fmt(summary.get("best_vs_none"), "%.2fx"))
            if best else "-",
            (_verdict(summary.get("best_vs_bound"), BEST_VS_BOUND) if judged
             else _fmt(summary.get("best_vs_bound"), "%.2fx")) + _bytes_alone(summary),
            _in_step(summary), _fmt(summary.get("hidden"), "%.2f"),
            "%s: %s%s" % (summary.get("auto_choice") or "-",
                          _verdict(summary.get("auto_vs_best"), AUTO_VS_BEST),
                          "" if summary.get("auto_probe_s") is None else
                          ", probe cost %.0f s" % summary["auto_probe_s"]),
            _verdict(summary.get("torchrec_vs_ours"), TORCHREC_RATIO, below=False),
            _verdict(summary.get("torchrec_pipelined_vs_ours"), TORCHREC_RATIO, below=False),
            _fmt(summary.get("wire_bound_ms")), bounding or "-"))
    return lines


def _in_step(summary):
    """The best mode over its in-step bound (`in_step_bound_ms`), e.g. "1.03x (23.2)"."""
    if summary.get("best_vs_in_step") is None:
        return "-"
    return "%.2fx (%.1f)" % (summary["best_vs_in_step"], summary["in_step_bound_ms"])


def _bytes_alone(summary):
    """" (its bytes alone 1.34x)" where the best mode's bytes take longer on the link than
    `BEST_VS_BOUND` x the compute-only bound (no overlap reaches that target with them); ""
    otherwise."""
    alone = summary.get("link_vs_bound")
    return " (its bytes alone %.2fx)" % alone if alone and alone > BEST_VS_BOUND else ""


def hidden_share(row, none, bound):
    """The share of none's exposed communication (none - compute-only) that `row` removes:
    (1 - row / none) / (1 - compute-only / none), both ratios paired by round."""
    if not (row and none and bound):
        return None
    exposed = 1.0 - _ratio(bound, none)
    return (1.0 - _ratio(row, none)) / exposed if exposed > 0 else None


def timeline_lines(rows):
    """One cell's per-mode stage and wait table (worker 0's profile, medians over its steps),
    with each mode's timed ms/step, its ratio to none and the share of none's exposure it
    hides."""
    none, bound = _ours(rows, "none"), _system(rows, "compute_only")
    lines = ["| mode | timed ms/step | vs none | exposure hidden | profiled step ms | "
             + " | ".join(STAGE_COLUMNS) + " | waits: " + " | ".join(WAIT_COLUMNS)
             + " | all waits |",
             "|---|" + "---|" * (5 + len(STAGE_COLUMNS) + len(WAIT_COLUMNS))]
    for row in rows:
        stages = row.get("stages")
        if row["system"] != "nestpipe" or not stages:
            continue
        lines.append("| %s | %s | %s | %s | %.1f | %s | %s | %.1f |" % (
            row["pipeline"], _fmt(row.get("ms_median")), _fmt(_ratio(row, none), "%.2fx"),
            _fmt(hidden_share(row, none, bound), "%.2f"), stages["step_ms"],
            " | ".join("%.1f" % stages["stage_ms"][k] for k in STAGE_COLUMNS),
            " | ".join("%.1f" % stages["wait_ms"][k] for k in WAIT_COLUMNS),
            stages["waiting_ms"]))
    return lines


def _demoted(markdown):
    return "\n".join(("##" + line) if line.startswith("#") else line
                     for line in markdown.splitlines())


def _previous(family, declared):
    """The cells of the family's last results (bench/results/FAMILY.json) that are still
    declared, {name: stored cell}; {} when there is none."""
    try:
        with open(os.path.join(RESULTS, family + ".json")) as f:
            cells = json.load(f).get("cells", {})
    except (OSError, ValueError):
        return {}
    return {name: dict(cell, markdown=cell.get("markdown", ""), run=cell.get("run", "an earlier run"))
            for name, cell in cells.items() if name in declared and "rows" in cell}


def join(family, about, cell_names, command, started, load_start, load_end, declared=None):
    """Writes bench/results/FAMILY.{md,json} from the cells' results and removes them. A
    declared cell this run did not measure keeps its last results (with their own command,
    date and load), so that a run of a subset (`--quick`, `--cells`) updates the family's one
    file set instead of dropping its other cells.

    Args:
      declared: The family's cell names in order (default: `cell_names`).

    Returns:
      The path of the Markdown file.
    """
    declared = list(declared or cell_names)
    stored = _previous(family, declared)
    run_text = "`%s` (%s, %.0f min; load average %.2f at the start, %.2f at the end)" % (
        command, time.strftime("%Y-%m-%d %H:%M"), (time.time() - started) / 60, load_start,
        load_end)
    for name in cell_names:
        base = os.path.join(RESULTS, cell_output(family, name))
        with open(base + ".json") as f:
            rows = json.load(f)
        with open(base + ".md") as f:
            markdown = f.read()
        stored[name] = {"run": run_text, "summary": summarize_cell(rows), "rows": rows,
                        "markdown": markdown}
        for ext in (".json", ".md", ".png"):
            if os.path.exists(base + ext):
                os.remove(base + ext)
    order = [n for n in declared if n in stored]
    # Summaries are recomputed from each cell's rows, so a kept cell is judged by today's rules.
    for n in order:
        stored[n]["summary"] = summarize_cell(stored[n]["rows"])
    cells = [(n, stored[n]["summary"]) for n in order]
    documents = [(n, stored[n]["rows"], stored[n]["markdown"]) for n in order]
    data = {n: stored[n] for n in order}
    missing = [n for n in declared if n not in stored]
    lines = ["# %s" % family, "", about + ".", "",
             "Latest command: %s. Each cell says the run that measured it; each cell's CPU "
             "steal is in its table below." % run_text, ""] + (
                 ["Declared cells not measured yet: %s." % ", ".join(missing), ""]
                 if missing else []) + [
             "Per cell: **exposed share** = 1 - compute-only / none (paired by round; the part of ours' plain "
             "step that is communication nobody hides); **hidden** = (none - best) / (none - "
             "compute-only), the share of that exposure the best pipelined mode removes; ratios "
             "are paired by interleaved round. Targets where the exposed share is >= %.2f: best "
             "<= %.2fx none and <= %.2fx compute-only; everywhere: auto <= %.2fx the best of "
             "none and the pipelines, TorchRec >= %.2fx ours' best. The wait columns come from "
             "worker 0's profile (bench/step_stages.py: a gap with no op running, charged to "
             "the exchange the op ending it consumes). \"its bytes alone\": the best mode's bytes' "
             "time on the link over the compute-only bound, where it exceeds %.2fx: no overlap "
             "meets that target without fewer bytes. **In-step bound** = compute-only + the "
             "time on the link of the best mode's bytes that follow its last backward (its row "
             "gradients and its share of the dense all-reduce), or all its bytes' time on the "
             "link if longer: every mode applies a step's update before the step ends (the "
             "tables are current whenever control returns between steps), so nothing of the "
             "same step is left to overlap those exchanges; only the next step's compute could "
             "(deferred gradients, docs/design/design.md section 4, not built)." % (
                 EXPOSED_MIN, BEST_VS_NONE, BEST_VS_BOUND, AUTO_VS_BEST, TORCHREC_RATIO,
                 BEST_VS_BOUND), ""]
    lines += summary_lines(cells)
    for name, rows, markdown in documents:
        lines += ["", "## %s" % name, "", "Measured by %s." % data[name]["run"], "",
                  "Per-stage timeline of ours (ms per step, worker 0):",
                  ""] + timeline_lines(rows) + ["", _demoted(markdown)]
    path = os.path.join(RESULTS, family + ".md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, family + ".json"), "w") as f:
        json.dump({"family": family, "command": command, "cells": data}, f, indent=1)
    return path
