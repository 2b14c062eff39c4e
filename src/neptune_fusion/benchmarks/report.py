"""The benchmark's results as text: one console line per case, a markdown table per suite, and a
figure of the speed-ups (matplotlib, where installed).

Example:
    >>> row = {"suite": "decode", "op": "dc_gqa", "seq": 4096, "timer": "device",
    ...        "ours": {"us": 16.0, "rel_err": 2.5e-4, "correct": True},
    ...        "baselines": {"sdpa_cudnn": {"us": 17.0, "rel_err": 2.4e-4, "correct": True}},
    ...        "speedup_vs": {"sdpa_cudnn": 1.0625}, "fastest": "sdpa_cudnn", "speedup_vs_fastest": 1.0625}
    >>> line(row)
    'dc_gqa       4096  ours     16.0 us (err 2.5e-04)  sdpa_cudnn 17.0 (1.06x)'
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# baselines in this order in the tables and the figure; others (and "before") after them
ORDER = ("fa4", "flex_flash", "flex", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa", "torch_compile", "torch")


def _us(value: float) -> str:
    return f"{value:.1f}" if value < 10000 else f"{value:.0f}"


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.1e}x"  # the interpreter's ratios are tiny


def _cell(entry: dict[str, Any], ratio: float | None) -> str:
    if "error" in entry:
        return "failed"
    if "us" not in entry:
        return "—"
    if not entry.get("correct"):
        return f"{_us(entry['us'])} (wrong: err {entry.get('rel_err', float('nan')):.1e})"
    return f"{_us(entry['us'])} ({_x(ratio)})" if ratio is not None else _us(entry["us"])


def size(row: dict[str, Any]) -> str:
    """The key length, or for cases without one their input shapes."""
    if row.get("seq") is not None:
        return str(row["seq"])
    return ", ".join("x".join(map(str, shape)) for shape in row.get("shapes", []))


def line(row: dict[str, Any]) -> str:
    """One case on one line: our time and error, then each baseline's time and ratio."""
    head = f"{row['op']:11s} {size(row):>5s}"
    if "error" in row:
        return f"{head}  case failed: {row['error']}"
    ours = row["ours"]
    if "error" in ours:
        mine = f"ours FAILED: {ours['error']}"
    else:
        flag = "" if ours.get("correct") else " WRONG"
        mine = f"ours {_us(ours.get('us', float('nan'))):>8s} us (err {ours.get('rel_err', float('nan')):.1e}{flag})"
    ratios = row.get("speedup_vs", {})
    cells = [f"{name} {_cell(entry, ratios.get(name))}" for name, entry in _ordered(row["baselines"])]
    return "  ".join([head, mine, *cells])


def _ordered(baselines: dict[str, Any]) -> list[tuple[str, Any]]:
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(baselines.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0]))


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row.get("baselines", {})))
        names.update(dict.fromkeys(row.get("skipped", {})))
    return [name for name, _ in _ordered(dict.fromkeys(names))]


def markdown(payload: dict[str, Any]) -> str:
    """A header with the environment, then per suite a table (cells: median us and baseline / ours)
    and the notes: baselines not run, and failures."""
    env, settings = payload["environment"], payload["settings"]
    where = (f"{env['gpu']} ({env['sms']} SMs)" if env.get("gpu") else "CPU, Triton interpreter")
    lines = [f"# neptune-fusion bench, {env['date']}", "",
             f"{where}; torch {env['torch']}, triton {env['triton']}, neptune_fusion {env['neptune_fusion']}"
             + (f" (git {env['git']})" if env.get("git") else "") + ".",
             f"Timer: {settings['timer']}, {settings['rounds']} interleaved round(s)."
             " Cells: microseconds per call (host cases: host time per call) and, in brackets, baseline / ours"
             " (above 1: ours is faster); every output checked against fp32 on the same random inputs;"
             " ratios only against correct baselines.", ""]
    rows = payload["results"]
    for suite in dict.fromkeys(r["suite"] for r in rows):
        mine = [r for r in rows if r["suite"] == suite]
        columns = _columns(mine)
        lines += [f"## {suite}", "", "| op | seq / sizes | ours | rel err | " + " | ".join(columns) + " | vs fastest |",
                  "|" + "---|" * (len(columns) + 5)]
        notes: dict[str, list[str]] = {}
        for row in mine:
            label = f"{row['op']} {size(row)}"
            if "error" in row:
                lines.append(f"| {row['op']} | {size(row)} | case failed | | " + " | " * len(columns) + " |")
                notes.setdefault(f"case failed: {row['error']}", []).append(label)
                continue
            ours, ratios = row["ours"], row.get("speedup_vs", {})
            if "error" in ours:
                notes.setdefault(f"ours failed: {ours['error']}", []).append(label)
            mine_cell = "failed" if "error" in ours else (_us(ours["us"]) if "us" in ours else "—")
            err = f"{ours['rel_err']:.1e}" + ("" if ours.get("correct") else " (wrong)") if "rel_err" in ours else ""
            cells = []
            for name in columns:
                if name in row["baselines"]:
                    entry = row["baselines"][name]
                    cells.append(_cell(entry, ratios.get(name)))
                    if "error" in entry:
                        notes.setdefault(f"{name} failed: {entry['error']}", []).append(label)
                elif name in row.get("skipped", {}):
                    cells.append("not run")
                    notes.setdefault(f"{name} not run: {row['skipped'][name]}", []).append(label)
                else:
                    cells.append("")
            fastest = f"{_x(row['speedup_vs_fastest'])} ({row['fastest']})" if "fastest" in row else ""
            lines.append(f"| {row['op']} | {size(row)} | {mine_cell} | {err} | " + " | ".join(cells)
                         + f" | {fastest} |")
        info = payload.get("summary", {}).get("suites", {}).get(suite)
        if info:
            g = info["geomean_speedup_vs_fastest"]
            lines += ["", f"{info['correct']} of {info['cases']} correct"
                      + (f"; geomean vs the fastest other system {g:.3f}x." if g is not None else ".")]
        floors = payload.get("host_floors_us") if suite == "host" else None
        if floors:
            lines += ["", "Host floors in this run: " + ", ".join(f"{k} {v:.1f} us" for k, v in floors.items()) + "."]
        if notes:
            lines += [""] + [f"- {note} ({', '.join(labels)})" for note, labels in notes.items()]
        lines.append("")
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> str | None:
    """Speed-ups over each baseline, one panel per suite, bars per case (log scale, 1 marked); None
    when written, else why not."""
    try:
        import matplotlib
    except ImportError:
        return f"matplotlib is not installed: no {path.name} (pip install matplotlib, or neptune-fusion[bench])"
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in payload["results"] if r.get("speedup_vs")]
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    if not suites:
        return f"no speed-ups to plot (no case was correct and timed beside a correct baseline): no {path.name}"
    widest = max(sum(r["suite"] == s for r in rows) for s in suites)
    every = [n for n, _ in _ordered(dict.fromkeys(n for r in rows for n in r["speedup_vs"]))]
    color = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(every)}  # one colour per baseline
    fig, axes = plt.subplots(len(suites), 1, figsize=(max(8.0, 0.9 * widest + 3), 3.6 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        mine = [r for r in rows if r["suite"] == suite]
        names = [n for n, _ in _ordered(dict.fromkeys(n for r in mine for n in r["speedup_vs"]))]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i, r in enumerate(mine) if name in r["speedup_vs"]]
            ys = [r["speedup_vs"][name] for r in mine if name in r["speedup_vs"]]
            # bars start at 1 (as fast as the baseline): up where ours is faster, down where slower
            bars = ax.bar(xs, [y - 1.0 for y in ys], width, bottom=1.0, label=name, color=color[name])
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6, rotation=90, padding=2)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xticks(range(len(mine)), [f"{r['op']}\n{r['seq']}" if r.get("seq") else r["op"] for r in mine],
                      fontsize=8)
        ax.set_ylabel("baseline time / ours")
        ax.set_title(f"{suite}: above 1, ours is faster")
        ax.legend(fontsize=7, ncols=min(len(names), 5), loc="best")
        top = max(max(r["speedup_vs"].values()) for r in mine)
        bottom = min(min(r["speedup_vs"].values()) for r in mine)
        ax.set_ylim(2 ** math.floor(math.log2(min(bottom, 1.0)) - 0.3), 2 ** math.ceil(math.log2(max(top, 1.0)) + 0.3))
    env = payload["environment"]
    fig.suptitle(f"neptune_fusion on {env.get('gpu') or 'CPU (interpreter)'}, {env['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
