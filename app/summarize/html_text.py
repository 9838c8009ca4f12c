"""HTML → plain text with the stdlib parser: scripts and styles dropped, block elements become
line breaks, headings keep a markdown-style marker so the chunker can split on them."""
from __future__ import annotations

import re
from html.parser import HTMLParser

_SKIP = {"script", "style", "noscript", "template", "head"}
_BLOCK = {"p", "div", "section", "article", "br", "li", "ul", "ol", "table", "tr", "pre", "blockquote",
          "header", "footer", "nav", "aside", "main", "dl", "dt", "dd", "hr", "figure", "figcaption"}
_LINE_STARTS = {"li", "dt", "dd", "br", "tr"}  # a line break before, none after
_HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in _SKIP:
            self.skip_depth += 1
        elif tag in _HEADINGS:
            self.parts.append("\n\n" + "#" * _HEADINGS[tag] + " ")
        elif tag in _BLOCK:
            self.parts.append("\n\n" if tag in ("p", "section", "article", "table", "pre", "blockquote") else "\n")

    def handle_endtag(self, tag) -> None:
        if tag in _SKIP:
            self.skip_depth = max(0, self.skip_depth - 1)
        elif tag in _HEADINGS or tag in ("p", "pre", "blockquote", "table"):
            self.parts.append("\n\n")
        elif tag in _BLOCK and tag not in _LINE_STARTS:
            self.parts.append("\n")

    def handle_data(self, data) -> None:
        if not self.skip_depth:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    text = "".join(parser.parts)
    text = re.sub(r"[ \t\r\f\v]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n" if text.strip() else ""
