"""Small hand-written SVG charts for docs/BENCHMARKS.md: grouped horizontal bars, no dependencies.

One kind of chart serves every figure: categories down the side (models, cases, client
counts), one bar per series in each (Reame, llama.cpp's tool, the ceiling), the value
written at the bar's end. A reference line (1.0 for ratios) can be drawn across.
"""

from __future__ import annotations

from html import escape

PALETTE = ("#2b6cb0", "#dd6b20", "#718096", "#38a169", "#805ad5", "#c53030")
WIDTH = 760
CHAR_WIDTH = 6.6  # px per character of a 12 px sans-serif label, roughly
BAR_HEIGHT = 14
GAP = 10
TOP = 56


def bar_chart(title: str, categories: list[str], series: dict[str, list[float | None]], unit: str,
              reference: float | None = None, digits: int = 1) -> str:
    """An SVG document: for each category, one bar per series (None: no bar, "n/a" written)."""
    if not categories or not series:
        raise ValueError("a chart needs at least one category and one series")
    if any(len(values) != len(categories) for values in series.values()):
        raise ValueError("every series needs one value per category")
    known = [value for values in series.values() for value in values if value is not None]
    if any(value < 0 for value in known):
        raise ValueError("bars are lengths: no negative values")
    top_value = max(known + ([reference] if reference is not None else []) + [1e-9])
    label_width = int(min(WIDTH / 2, 16 + CHAR_WIDTH * max(len(category) for category in categories)))
    plot = WIDTH - label_width - 90
    scale = plot / top_value
    group = len(series) * BAR_HEIGHT + GAP
    height = TOP + len(categories) * group + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(title)}</text>']
    x = 10
    for index, name in enumerate(series):  # the legend
        color = PALETTE[index % len(PALETTE)]
        out.append(f'<rect x="{x}" y="32" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 16}" y="42">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    out.append(f'<text x="{WIDTH - 10}" y="42" text-anchor="end" fill="#4a5568">{escape(unit)}</text>')
    for row, category in enumerate(categories):
        y = TOP + row * group
        out.append(f'<text x="{label_width - 8}" y="{y + group / 2}" text-anchor="end" '
                   f'dominant-baseline="middle">{escape(category)}</text>')
        for index, values in enumerate(series.values()):
            value = values[row]
            bar_y = y + index * BAR_HEIGHT
            if value is None:
                out.append(f'<text x="{label_width + 4}" y="{bar_y + BAR_HEIGHT - 3}" fill="#a0aec0">n/a</text>')
                continue
            length = max(1.0, value * scale)
            out.append(f'<rect x="{label_width}" y="{bar_y}" width="{length:.1f}" height="{BAR_HEIGHT - 2}" '
                       f'fill="{PALETTE[index % len(PALETTE)]}"/>')
            out.append(f'<text x="{label_width + length + 4:.1f}" y="{bar_y + BAR_HEIGHT - 3}">'
                       f'{value:,.{digits}f}</text>')
    if reference is not None:
        x_ref = label_width + reference * scale
        out.append(f'<line x1="{x_ref:.1f}" y1="{TOP - 6}" x2="{x_ref:.1f}" y2="{height - 14}" stroke="#1a202c" '
                   f'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x_ref:.1f}" y="{height - 3}" text-anchor="middle" fill="#1a202c">'
                   f'{reference:g}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
