"""What a person sees of a search: a line per trial, a final table, and an HTML report with
throughput against peak memory (an inline SVG: no plotting dependency)."""

import html
from pathlib import Path

from autofit.base.atomic import atomic_write_text
from autofit.base.sizes import format_bytes
from autofit.search import choice, SearchResult, TrialRecord
from autofit.profiles.profile import Profile

_COLOURS = {"ok": "#2a9d4b", "oom": "#d62828", "pruned": "#9a9a9a", "unhealthy": "#f4a000",
            "error": "#6a4c93", "timeout": "#6a4c93", "compile_error": "#6a4c93"}


def _peak(r: TrialRecord) -> int | None:
    return r.peak_memory_bytes if r.peak_memory_bytes is not None else r.predicted_peak_bytes


def format_trial_line(record: TrialRecord, best: TrialRecord | None, considered: int, total: int,
                      budget_bytes: int) -> str:
    peak = _peak(record)
    share = f"{peak / budget_bytes:4.0%}" if peak else "   -"
    estimated = " (est.)" if record.peak_memory_bytes is None and peak else ""
    speed = f"{record.samples_per_s:9.1f} samples/s" if record.measurement is not None and record.status == "ok" else " " * 19
    best_text = f"best {best.samples_per_s:.1f}" if best is not None else "best -"
    reason = f"  [{record.reason}]" if record.reason and record.status != "ok" else ""
    m = record.measurement
    if record.loaded:
        reason += f"  [host busy: {m.foreign_cores:.1f} of {m.cores} cores with other work]"
    compiled = record.measurement.compile_s if record.measurement is not None else None
    compile_text = f"  compile {compiled:.1f} s" if compiled is not None else ""
    if record.status == "oom":  # what it needed is more than the budget, not the peak it reached
        return (f"trial #{record.number:<3} ({considered}/{total}) {record.config.short():<40} {record.status:<9} "
                f"needs > {format_bytes(budget_bytes)}  {' ' * 19}{best_text}{reason}")
    return (f"trial #{record.number:<3} ({considered}/{total}) {record.config.short():<40} {record.status:<9} "
            f"{format_bytes(peak):>10}{estimated} {share} of budget {speed}{compile_text}  {best_text}{reason}")


def _rows(result: SearchResult) -> list[TrialRecord]:
    """One row per search trial: repeats of a measured config and pruned proposals of a
    config proposed (or measured) more than once are left out."""
    measured = {r.config for r in result.records if r.measurement is not None}
    pruned = {r.config: r for r in result.records if r.status == "pruned" and r.config not in measured}
    rows = [r for r in result.records if r.measurement is not None and not r.repeat] + list(pruned.values())
    return sorted(rows, key=lambda r: (r.status != "ok", -r.samples_per_s))


def trials_table(result: SearchResult, winner: TrialRecord | None, validated: dict | None = None) -> str:
    """One row per config, numbered as the log numbers its trial, with the figure that decided
    its place, named, and sorted by it: its validated figure (`validated`: config ->
    Measurement) where it has one, else the central value of this session's measurements
    that ranked it (`choice.rank`: one trial, or the median of its trial and re-measures).
    The floors are named (one-liner, fallback); an out-of-memory row says it needed more
    than the budget."""
    figures = _deciding_figures(result, validated or {})
    rows = sorted(_rows(result), key=lambda r: (r.config not in figures, -figures.get(r.config, (0.0, ""))[0]))
    floors = {result.one_liner: "one-liner", result.fallback: "fallback"}
    lines = [f"{'':2}{'#':>4}  {'config':<40} {'status':<9} {'peak':>12} {'samples/s':>10}  decided by"]
    for r in rows:
        mark = "★" if winner is not None and r.config == winner.config else ""
        speed, source = figures.get(r.config, (None, ""))
        floor = f" ({floors[r.config]})" if r.config in floors else ""
        shown = f"{speed:10.1f}  {source}{floor}" if r.status == "ok" and speed is not None else f"{'-':>10}{floor}"
        peak = f"> {format_bytes(result.budget_bytes)}" if r.status == "oom" else format_bytes(_peak(r))
        lines.append(f"{mark:2}{r.number:>4}  {r.config.short():<40} {r.status:<9} {peak:>12} {shown}")
    return "\n".join(lines)


def _deciding_figures(result: SearchResult, validated: dict) -> dict:
    """config -> (samples/s, what it is) for each config that ran: validated, else ranked."""
    figures = {r.config: (r.samples_per_s, "trial") for r in result.records
               if r.status == "ok" and r.measurement is not None and not r.repeat}
    for k in choice.rank(result.records, result.budget_bytes, fresh_since=result.session_start):
        figures[k.record.config] = (k.samples_per_s, _ranked_source(k))
    figures.update({c: (m.samples_per_s, "validated") for c, m in validated.items()})
    return figures


def _ranked_source(ranked: choice.Ranked) -> str:
    """What a ranked figure is: a trial, a re-measure or a median, and the runs under foreign
    load it leaves out (`choice.rank`)."""
    if ranked.measurements > 1:
        text = f"median of {ranked.measurements} runs"
    else:
        text = "re-measure" if ranked.record.repeat else "trial"
    left_out = ranked.runs - ranked.measurements
    return text + (f" ({left_out} under load left out)" if left_out else "")


def _svg(result: SearchResult, winner: TrialRecord | None, width: int = 760, height: int = 420) -> str:
    points = [(r, _peak(r)) for r in result.records if _peak(r)]
    if not points:
        return "<p>No trial has a memory figure.</p>"
    largest = max(max(p for _, p in points), result.budget_bytes)
    unit, unit_bytes = next((u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if largest >= b)
    max_x = largest * 1.08 / unit_bytes
    max_y = max([r.samples_per_s for r, _ in points] + [1.0]) * 1.12
    left, bottom, top, right = 70, 50, 40, 20
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(v: float) -> float:
        return left + plot_w * v / max_x

    def y(v: float) -> float:
        return top + plot_h * (1 - v / max_y)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>']
    for i in range(6):
        gx, gy = max_x * i / 5, max_y * i / 5
        parts.append(f'<text x="{x(gx):.1f}" y="{height - bottom + 18}" text-anchor="middle">{gx:.2f}</text>')
        parts.append(f'<text x="{left - 8}" y="{y(gy) + 4:.1f}" text-anchor="end">{gy:.0f}</text>')
    budget = result.budget_bytes / unit_bytes
    parts.append(f'<line x1="{x(budget):.1f}" y1="{top}" x2="{x(budget):.1f}" y2="{top + plot_h}" stroke="#d62828" stroke-dasharray="6,4"/>')
    parts.append(f'<text x="{x(budget) - 4:.1f}" y="{top + 14}" text-anchor="end" fill="#d62828">budget {budget:.2f} {unit}</text>')
    for r, peak in points:
        colour = _COLOURS.get(r.status, "#333")
        tip = html.escape(f"#{r.number} {r.config.short()}: {r.status}, {format_bytes(peak)}, {r.samples_per_s:.1f} samples/s")
        cx, cy = x(peak / unit_bytes), y(r.samples_per_s)
        if winner is not None and r.number == winner.number:
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="9" fill="none" stroke="#000" stroke-width="2"><title>{tip}</title></circle>')
        fill = "none" if r.status == "pruned" else colour
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{fill}" stroke="{colour}" stroke-width="1.5"><title>{tip}</title></circle>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">peak memory ({unit}; pruned: predicted)</text>')
    parts.append(f'<text transform="rotate(-90)" x="{-(top + plot_h / 2)}" y="16" text-anchor="middle">samples/s</text>')
    legend_x = left + 10
    for i, (status, colour) in enumerate(_COLOURS.items()):
        if status in ("timeout", "compile_error"):  # drawn as error
            continue
        parts.append(f'<circle cx="{legend_x + i * 95}" cy="{top - 16}" r="5" fill="{colour}"/>'
                     f'<text x="{legend_x + i * 95 + 9}" y="{top - 12}">{status}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _frontier_html(profile: Profile) -> str:
    """The profile's validated frontier: what runs at start when less memory is free."""
    rows = "".join(f"<tr><td>{html.escape(p.config.short())}</td><td>{format_bytes(p.measured.peak_memory_bytes)}</td>"
                   f"<td>{p.measured.samples_per_s:.1f}</td></tr>" for p in profile.points)
    return ("<p>Frontier, validated over as many steps as the winner: at start the fastest point whose peak "
            "fits the memory free is run.</p><table><tr><th>config</th><th>peak</th><th>samples/s</th></tr>"
            f"{rows}</table>")


def write_html_report(path: Path, profile: Profile, result: SearchResult, winner: TrialRecord | None) -> Path:
    rows = []
    for r in _rows(result):
        mark = "★" if winner is not None and r.number == winner.number else ""
        speed = f"{r.samples_per_s:.1f}" if r.status == "ok" else ""
        rows.append(f"<tr><td>{mark}</td><td>{r.number}</td><td>{html.escape(r.config.short())}</td>"
                    f"<td style='color:{_COLOURS.get(r.status, '#333')}'>{r.status}</td>"
                    f"<td>{format_bytes(r.peak_memory_bytes)}</td><td>{format_bytes(r.predicted_peak_bytes)}</td>"
                    f"<td>{speed}</td><td>{html.escape(r.reason or '')}</td></tr>")
    s = profile.search
    speedup = f"{s.speedup:.2f}× over 32-true at the largest micro batch that fits" if s.speedup else "no 32-true baseline fitted"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>autofit: {html.escape(profile.model.name)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}td,th{{padding:2px 8px;text-align:left}}
tr:nth-child(even){{background:#f3f3f3}}</style></head><body>
<h1>{html.escape(profile.model.name)} on {html.escape(profile.device.name)}</h1>
<p>Winner: <b>{html.escape(profile.config.short())}</b> — {profile.measured.samples_per_s:.1f} samples/s validated over
{profile.measured.validated_steps} steps, peak {format_bytes(profile.measured.peak_memory_bytes)} of a
{format_bytes(profile.budget_bytes)} budget; {speedup}.</p>
<p>{s.trials} trials: {s.measured} measured, {s.pruned} pruned by the memory estimate, {s.oom} out of memory,
{s.unhealthy} unhealthy, {s.failed} failed; search wall time {s.wall_s:.0f} s; stopped: {html.escape(s.stop_reason)}.</p>
{f"<p>Choice: {html.escape(s.choice)}.</p>" if s.choice else ""}
{f"<p><b>Note:</b> {html.escape(s.note)}.</p>" if s.note else ""}
{_frontier_html(profile)}
{_svg(result, winner)}
<table><tr><th></th><th>#</th><th>config</th><th>status</th><th>peak</th><th>predicted</th><th>samples/s</th><th>reason</th></tr>
{''.join(rows)}</table></body></html>
"""
    return atomic_write_text(path, page)
