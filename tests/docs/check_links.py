#!/usr/bin/env python3
"""Checks that the documentation's links and file names resolve (issue 54: a house a newcomer can walk).

Pages: README.md, CHANGELOG.md and every docs/**/*.md. In each, outside fenced code blocks and
inline code spans:
  * every relative link, inline `[text](target)` or `![alt](target)` and reference definition
    `[label]: target`, must name an existing file or directory of the repository (external links,
    `scheme:...`, are not fetched);
  * every `#anchor`, alone (this page) or after a Markdown file, must be a heading of that page by
    GitHub's slug rule (the heading's text, lower-cased, every character that is not a letter,
    mark, number, connector punctuation such as `_`, space or hyphen removed, spaces turned into
    hyphens; a slug taken already gets "-1", "-2", ...: github-slugger's rule, checked at start
    against its test vectors) or an HTML `id="..."` / `name="..."`; `#L12` / `#L12-L20` after any
    other file must be lines it has. A link or a code span may continue on the next line of its
    paragraph.
In README.md and the pages of PATH_PAGES, also every repository path written in backquotes, or in
a fenced code block, that starts with src/, include/, tests/, jobs/, scripts/ or docs/ must exist
(so that the file tour and the commands cannot rot).

Prints one line per broken target, `FILE:LINE: ...`, and exits 1 if there is any (or if the slug
rule fails its vectors); else prints what it checked and exits 0. Usage: check_links.py [--root DIR] (default: the repository holding this
script). Python 3 standard library only.
"""
import argparse
import glob
import os
import re
import sys
import unicodedata
import urllib.parse

# Pages whose backquoted repository paths are checked besides README.md. Left out: pages that are
# dated records or name files of other repositories (benchmarks.md, scaling.md, preemption-mpirun.md,
# slurm-startup-crash.md), and architecture.md until its rewrite for the per-layer headers (issue 54).
PATH_PAGES = [
    "CHANGELOG.md",
    "docs/checkpoint-format.md",
    "docs/checkpoints.md",
    "docs/data-format.md",
    "docs/demo.md",
    "docs/errors.md",
    "docs/gpu.md",
    "docs/huggingface.md",
    "docs/monitoring.md",
    "docs/parallelism.md",
    "docs/running.md",
    "docs/slurm.md",
    "docs/testing.md",
]
PATH_PREFIXES = ("src/", "include/", "tests/", "jobs/", "scripts/", "docs/")
PATH_RE = re.compile(r"^(?:src|include|tests|jobs|scripts|docs)/[A-Za-z0-9_.+/-]*$")

FENCE_RE = re.compile(r"^\s*(`{3,}|~{3,})")
HEADING_RE = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
CODE_SPAN_RE = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK_RE = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^()\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REF_DEF_RE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ID_RE = re.compile(r"<[a-zA-Z][^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']")
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
LINE_ANCHOR_RE = re.compile(r"^L(\d+)(?:-L(\d+))?$")


def heading_text(raw):
    """The text GitHub renders for a heading's Markdown: links and images to their text, no code
    backquotes, no emphasis asterisks, no HTML tags, no closing #s."""
    s = re.sub(r"[ \t]+#+$", "", raw.strip())
    s = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"<[^>]+>", "", s)
    return s.replace("`", "").replace("*", "").strip()


def slug(text):
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if cat[0] in "LMN" or cat == "Pc" or ch == "-":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


class Slugger:
    """GitHub's anchors of one page: a slug taken already gets "-1", "-2", ... (github-slugger)."""

    def __init__(self):
        self.occurrences = {}

    def slug(self, text):
        base = result = slug(text)
        while result in self.occurrences:
            self.occurrences[base] += 1
            result = f"{base}-{self.occurrences[base]}"
        self.occurrences[result] = 0
        return result


# Test vectors of github-slugger (test/fixtures.json of Flet/github-slugger, the rule GitHub's
# anchors follow), in order: one Slugger, so the duplicates count as they do on a page.
SLUG_FIXTURES = [
    ("alpha", "alpha"), ("alpha", "alpha-1"), ("bravoCharlieDelta", "bravocharliedelta"),
    ("__proto__", "__proto__"), ("__proto__", "__proto__-1"),
    ("echo", "echo"), ("echo", "echo-1"), ("echo 1", "echo-1-1"), ("echo-1", "echo-1-2"), ("echo", "echo-2"),
    ("foxtrot-1", "foxtrot-1"), ("foxtrot", "foxtrot"), ("foxtrot", "foxtrot-2"),
    ("heading with a - dash", "heading-with-a---dash"),
    ("heading with an _ underscore", "heading-with-an-_-underscore"),
    ("heading with a period.txt", "heading-with-a-periodtxt"),
    ("exchange.bind_headers(exchange, routing [, bindCallback])", "exchangebind_headersexchange-routing--bindcallback"),
    (" a", "-a"), ("a ", "a-"), ("-a-", "-a-"), ("-a-", "-a--1"),
    ("apostrophe\u2019s should be trimmed", "apostrophes-should-be-trimmed"),
    ("I \u2665 unicode", "i--unicode"), ("en\u2013dash", "endash"),
    ("\U0001F604 unicode emoji", "-unicode-emoji"),
    ("\u041f\u0440\u0438\u0432\u0435\u0442 non-latin \u4f60\u597d", "\u043f\u0440\u0438\u0432\u0435\u0442-non-latin-\u4f60\u597d"),
]


def slug_self_test():
    """The slug rule against github-slugger's vectors; a list of the ones it gets wrong."""
    s = Slugger()
    return [(text, want, got) for text, want in SLUG_FIXTURES if (got := s.slug(text)) != want]


class Page:
    """A Markdown file split into lines, with what is code and what is prose."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            self.lines = f.read().split("\n")
        self.fenced = []  # per line: inside a fenced code block (the fence lines included)
        fence = None
        for line in self.lines:
            m = FENCE_RE.match(line)
            if fence is None and m:
                fence = m.group(1)
                self.fenced.append(True)
            elif fence is not None:
                self.fenced.append(True)
                if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):].strip():
                    fence = None
            else:
                self.fenced.append(False)
        self._anchors = None

    def anchors(self):
        if self._anchors is None:
            slugger = Slugger()
            anchors = set()
            for line, fenced in zip(self.lines, self.fenced):
                if fenced:
                    continue
                m = HEADING_RE.match(line)
                if m:
                    anchors.add(slugger.slug(heading_text(m.group(2) or "")))
                for hid in HTML_ID_RE.findall(line):
                    anchors.add(hid)
            self._anchors = anchors
        return self._anchors


class Checker:
    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.pages = {}
        self.errors = []
        self.counts = {"links": 0, "anchors": 0, "paths": 0}

    def page(self, abspath):
        if abspath not in self.pages:
            self.pages[abspath] = Page(abspath)
        return self.pages[abspath]

    def rel(self, abspath):
        return os.path.relpath(abspath, self.root)

    def error(self, where, lineno, msg):
        self.errors.append(f"{where}:{lineno}: {msg}")

    def exists(self, relpath):
        """Whether a repository path exists."""
        relpath = relpath.rstrip("/") or "."
        return os.path.exists(os.path.join(self.root, relpath))

    def check_link(self, src, lineno, target):
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1]
        if SCHEME_RE.match(target) or target.startswith("//"):
            return  # external
        self.counts["links"] += 1
        path, _, anchor = target.partition("#")
        path = urllib.parse.unquote(path)
        where = self.rel(src)
        if path:
            if path.startswith("/"):
                self.error(where, lineno, f"link '{target}': an absolute path (GitHub resolves it against the site, not the repository)")
                return
            dest = os.path.normpath(os.path.join(os.path.dirname(src), path))
            relpath = os.path.relpath(dest, self.root)
            if relpath.startswith(".."):
                self.error(where, lineno, f"link '{target}': leads outside the repository")
                return
            if not self.exists(relpath):
                self.error(where, lineno, f"link '{target}': no such file or directory '{relpath}'")
                return
        else:
            dest = src
        if not anchor:
            return
        self.counts["anchors"] += 1
        anchor = urllib.parse.unquote(anchor)
        if not os.path.isfile(dest):
            self.error(where, lineno, f"link '{target}': '#{anchor}' after a directory")
            return
        if dest.endswith(".md"):
            if anchor not in self.page(dest).anchors():
                self.error(where, lineno, f"link '{target}': no heading '#{anchor}' in {self.rel(dest)}")
            return
        m = LINE_ANCHOR_RE.match(anchor)
        if not m:
            self.error(where, lineno, f"link '{target}': '#{anchor}' is neither a heading (not a Markdown file) nor a line '#L<n>'")
            return
        with open(dest, encoding="utf-8", errors="replace") as f:
            n = sum(1 for _ in f)
        last = int(m.group(2) or m.group(1))
        if last > n or int(m.group(1)) < 1:
            self.error(where, lineno, f"link '{target}': {self.rel(dest)} has {n} lines")

    def check_path_token(self, src, lineno, token):
        token = token.strip("\"'()[],;:")
        token = token.rstrip(".")
        if not token.startswith(PATH_PREFIXES) or not PATH_RE.match(token):
            return
        self.counts["paths"] += 1
        if not self.exists(token):
            self.error(self.rel(src), lineno, f"path '{token}' does not exist")

    def blocks(self, page):
        """The prose of a page as (first line number, text) blocks: a paragraph's lines joined, since
        a code span or a link may continue on the next line; a table row, a heading or a reference
        definition is a block of its own. Fenced code is left out."""
        block, start = [], 0
        for i, (line, fenced) in enumerate(zip(page.lines, page.fenced), start=1):
            alone = line.lstrip().startswith("|") or HEADING_RE.match(line) or REF_DEF_RE.match(line)
            if fenced or not line.strip() or alone:
                if block:
                    yield start, "\n".join(block)
                    block = []
                if alone and not fenced:
                    yield i, line
                continue
            if not block:
                start = i
            block.append(line)
        if block:
            yield start, "\n".join(block)

    def check_page(self, src, check_paths):
        page = self.page(src)
        if check_paths:
            for i, (line, fenced) in enumerate(zip(page.lines, page.fenced), start=1):
                if fenced and not FENCE_RE.match(line):
                    for token in re.split(r"[\s=]+", line):
                        self.check_path_token(src, i, token)
        for start, text in self.blocks(page):
            def lineno(offset):
                return start + text.count("\n", 0, offset)
            spans = list(CODE_SPAN_RE.finditer(text))
            prose = CODE_SPAN_RE.sub(lambda m: " " * len(m.group(0)), text)
            for m in INLINE_LINK_RE.finditer(prose):
                self.check_link(src, lineno(m.start(2)), m.group(2))
            m = REF_DEF_RE.match(prose)
            if m:
                self.check_link(src, start, m.group(1))
            if check_paths:
                for m in spans:
                    span = m.group(2).strip()
                    tokens = [span] if PATH_RE.match(span) else re.split(r"[\s=]+", span)
                    for token in tokens:
                        self.check_path_token(src, lineno(m.start(2)), token)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    args = ap.parse_args()
    wrong = slug_self_test()
    if wrong:
        for text, want, got in wrong:
            print(f"check_links: slug rule: {text!r} gives {got!r}, GitHub gives {want!r}")
        return 1
    checker = Checker(args.root)
    root = checker.root
    pages = [os.path.join(root, "README.md"), os.path.join(root, "CHANGELOG.md")]
    pages += sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
    missing = [p for p in pages[:2] if not os.path.isfile(p)]
    for p in missing:
        checker.error(checker.rel(p), 0, "page missing")
    path_pages = {os.path.join(root, "README.md")} | {os.path.join(root, p) for p in PATH_PAGES}
    for p in sorted(path_pages - set(pages[:2])):
        if not os.path.isfile(p):
            checker.error(checker.rel(p), 0, "page named in PATH_PAGES is missing")
    for p in pages:
        if os.path.isfile(p):
            checker.check_page(p, p in path_pages)
    if checker.errors:
        print("\n".join(checker.errors))
        print(f"check_links: {len(checker.errors)} broken (of {checker.counts['links']} links, "
              f"{checker.counts['anchors']} anchors, {checker.counts['paths']} paths in {len(pages)} pages)")
        return 1
    c = checker.counts
    print(f"check_links: {len(pages)} pages, {c['links']} links, {c['anchors']} anchors, {c['paths']} repository paths: all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
