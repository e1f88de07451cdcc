"""A record drawn as SVG: p99 time to first token and p99 inter-token latency against the request rate, each on
its own panel with its objective as a dashed line, and the ceiling as a vertical line on both."""

from __future__ import annotations

from html import escape

from gpufleet.measure.records import Record

WIDTH, PANEL_H, MARGIN = 720, 260, 60


def _scale(values: list[float], lo: float, hi: float, out_lo: float, out_hi: float) -> list[float]:
    span = (hi - lo) or 1.0
    return [out_lo + (v - lo) / span * (out_hi - out_lo) for v in values]


def _panel(record: Record, top: float, title: str, values: list[float | None], slo: float, unit: str) -> list[str]:
    rates = [s.rate for s in record.steps]
    x_hi = max(rates) * 1.05 if rates else 1.0
    y_hi = max([v for v in values if v is not None] + [slo]) * 1.15
    left, right, bottom = MARGIN, WIDTH - 20, top + PANEL_H - 40

    def x(rate: float) -> float:
        return _scale([rate], 0.0, x_hi, left, right)[0]

    def y(value: float) -> float:
        return _scale([value], 0.0, y_hi, bottom, top + 20)[0]

    out = [f'<text x="{left}" y="{top + 12}" font-size="13" font-weight="bold">{escape(title)}</text>',
           f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{bottom}" x2="{left}" y2="{top + 20}" stroke="black"/>',
           f'<text x="{right}" y="{bottom + 30}" font-size="11" text-anchor="end">requests/s</text>',
           f'<text x="{left - 8}" y="{top + 24}" font-size="11" text-anchor="end">{escape(unit)}</text>',
           f'<text x="{left - 8}" y="{y(y_hi / 1.15):.1f}" font-size="10" text-anchor="end">{y_hi / 1.15:.3g}</text>',
           f'<line x1="{left}" y1="{y(slo):.1f}" x2="{right}" y2="{y(slo):.1f}" stroke="red" stroke-dasharray="6,4"/>',
           f'<text x="{right}" y="{y(slo) - 4:.1f}" font-size="11" fill="red" text-anchor="end">'
           f'objective {slo:g} {escape(unit)}</text>']
    for rate in rates:
        out.append(f'<text x="{x(rate):.1f}" y="{bottom + 14}" font-size="10" text-anchor="middle">{rate:g}</text>')
    points = [(x(s.rate), y(v)) for s, v in zip(record.steps, values, strict=True) if v is not None]
    ordered = sorted(points)
    if ordered:
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in ordered)
        out.append(f'<polyline points="{path}" fill="none" stroke="steelblue" stroke-width="2"/>')
    for step, value in zip(record.steps, values, strict=True):
        if value is not None:
            color = "red" if step.missed(record.slo) else "steelblue"
            out.append(f'<circle cx="{x(step.rate):.1f}" cy="{y(value):.1f}" r="4" fill="{color}"/>')
    if (found := record.ceiling.rate) is not None:
        out.append(f'<line x1="{x(found):.1f}" y1="{bottom}" x2="{x(found):.1f}" y2="{top + 20}" stroke="green"'
                   ' stroke-dasharray="3,3"/>')
        out.append(f'<text x="{x(found) + 4:.1f}" y="{top + 32}" font-size="11" fill="green">ceiling {found:g}</text>')
    return out


def render_svg(record: Record) -> str:
    """The SVG document of ``record``."""
    title = f"{record.key.line()}, {record.date}"
    height = 2 * PANEL_H + 30
    body = [f'<text x="{MARGIN}" y="18" font-size="12">{escape(title)}</text>']
    body += _panel(record, 30, "time to first token, p99", [s.ttft_p99_s for s in record.steps],
                   record.slo.ttft_p99_s, "s")
    body += _panel(record, 30 + PANEL_H, "inter-token latency, p99", [s.itl_p99_s for s in record.steps],
                   record.slo.itl_p99_s, "s")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="sans-serif">\n' + "\n".join(body) + "\n</svg>\n")
