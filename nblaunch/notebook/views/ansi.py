"""Terminal text into HTML: escaping, and SGR colour codes as styled spans.

Ranks print what a terminal would show (colours, cursor moves, titles); the views show it in
HTML, where only the colours mean anything.
"""

from __future__ import annotations

import html
import re
from typing import Any

# Any escape sequence: CSI (ESC [ ... final byte), OSC (ESC ] ... BEL/ST) or a two-byte ESC x.
ANSI = re.compile(r"\x1b(?:\[([0-9;?]*)([@-~])|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# Control bytes other than tab: a terminal would act on them, a saved text must not carry them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BASIC = ("#000000", "#cd3131", "#0d7a3e", "#949800", "#0451a5", "#bc05bc", "#0598bc", "#555555")
_BRIGHT = ("#666666", "#e53e3e", "#16a34a", "#b59f00", "#2563eb", "#d946ef", "#0891b2", "#a5a5a5")


def esc(text: Any) -> str:
    """``str(text)``, HTML-escaped (quotes too: it goes into attributes as well)."""
    return html.escape(str(text), quote=True)


def plain(text: str) -> str:
    """``text`` without escape sequences."""
    return ANSI.sub("", text) if "\x1b" in text else text


def printable(text: str) -> str:
    """``text`` for a saved notebook's ``text/plain``: escape sequences dropped, and any other
    control byte (a lone ESC, BEL, backspace, NUL) shown as ``\\xNN``, never passed on raw."""
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", plain(text))


def strip_to_html(text: str) -> str:
    """HTML-escaped text without escape sequences (for one-line previews)."""
    return esc(ANSI.sub("", text)) if "\x1b" in text else esc(text)


def to_html(text: str) -> str:
    """HTML-escape ``text``, turning SGR colour codes into spans and dropping other escapes."""
    if "\x1b" not in text:
        return esc(text)
    out: list[str] = []
    style: dict[str, str] = {}
    pos = 0
    opened = False
    for match in ANSI.finditer(text):
        if match.start() > pos:
            out.append(esc(text[pos : match.start()]))
        pos = match.end()
        if match.group(2) != "m":
            continue  # cursor movement, erase line, titles: not meaningful in a log
        style = _apply_sgr(style, match.group(1) or "0")
        if opened:
            out.append("</span>")
            opened = False
        if style:
            css = ";".join(f"{k}:{v}" for k, v in sorted(style.items()))
            out.append(f"<span style='{css}'>")
            opened = True
    out.append(esc(text[pos:]))
    if opened:
        out.append("</span>")
    return "".join(out)


def _apply_sgr(style: dict[str, str], params: str) -> dict[str, str]:
    style = dict(style)
    codes = [int(c) if c.isdigit() else 0 for c in params.split(";")]
    i = 0
    while i < len(codes):
        code = codes[i]
        if code == 0:
            style.clear()
        elif code == 1:
            style["font-weight"] = "bold"
        elif code == 3:
            style["font-style"] = "italic"
        elif code == 4:
            style["text-decoration"] = "underline"
        elif code == 22:
            style.pop("font-weight", None)
        elif 30 <= code <= 37:
            style["color"] = _BASIC[code - 30]
        elif 90 <= code <= 97:
            style["color"] = _BRIGHT[code - 90]
        elif 40 <= code <= 47:
            style["background"] = _BASIC[code - 40]
        elif 100 <= code <= 107:
            style["background"] = _BRIGHT[code - 100]
        elif code == 39:
            style.pop("color", None)
        elif code == 49:
            style.pop("background", None)
        elif code in (38, 48) and i + 1 < len(codes):
            key = "color" if code == 38 else "background"
            if codes[i + 1] == 5 and i + 2 < len(codes):
                style[key] = _xterm_256(codes[i + 2])
                i += 2
            elif codes[i + 1] == 2 and i + 4 < len(codes):
                r, g, b = (min(255, c) for c in codes[i + 2 : i + 5])
                style[key] = f"#{r:02x}{g:02x}{b:02x}"
                i += 4
        i += 1
    return style


def _xterm_256(n: int) -> str:
    if n < 8:
        return _BASIC[n]
    if n < 16:
        return _BRIGHT[n - 8]
    if n < 232:
        n -= 16
        levels = (0, 95, 135, 175, 215, 255)
        return f"#{levels[n // 36]:02x}{levels[(n // 6) % 6]:02x}{levels[n % 6]:02x}"
    grey = 8 + 10 * (min(n, 255) - 232)
    return f"#{grey:02x}{grey:02x}{grey:02x}"
