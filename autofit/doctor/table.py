"""The doctor's table: a header, one line per check as it ends, a closing count."""

from autofit.base.sizes import format_bytes

_MARK = {"ok": "ok", "fail": "FAIL", "skip": "skip"}


def format_header(report: dict) -> str:
    d = report["device"]
    where = "cpu" if d["index"] is None else f"cuda:{d['index']}"
    return f"autofit doctor on {where}: {d['name']}, {format_bytes(d['memory_total_bytes'])} (torch {d['torch_version']})"


def format_line(check: dict) -> str:
    line = f"{check['name']:<12} {_MARK[check['status']]:<5} {check.get('wall_s', 0.0):6.1f}s  {check['summary']}"
    if check["status"] == "fail":
        if check["reason"] != check["summary"]:
            line += f"\n{'':<27}{check['reason']}"
        line += f"\n{'':<27}advice: {check['advice']}"
    return line


def format_summary(report: dict) -> str:
    counts = report["counts"]
    verdict = "every check holds" if report["ok"] else "some checks FAILED (exit 1)"
    return (f"{len(report['checks'])} checks: {counts['ok']} ok, {counts['fail']} failed, {counts['skip']} skipped "
            f"in {report['wall_s']:.1f} s: {verdict}")
