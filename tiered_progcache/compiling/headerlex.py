"""The preprocessor's reading of a header's bytes: the includes it names and the macros they go through.

Pure (no file is opened here): :mod:`.headerscan` reads each file, passes its bytes to
:func:`parse_includes`, and resolves what comes back on NVRTC's search path.

Directives are found the way the compiler finds them, on preprocessor tokens after
translation phases 1-3: line splices removed, each comment one space, ``%:`` is
``#``, string and raw-string literals skipped. Where a reading is in doubt (trigraphs,
a backslash followed by spaces, a lone CR) every reading counts; where the lexer
cannot tell at all (an unterminated comment or raw string) it says so (a ``COMPUTED``
entry with no name), and the scan falls back to whole directories.

Over-approximation, never under: ``#if`` is ignored (both branches count),
``__has_include`` counts like an include. A computed ``#include MACRO`` (and
``__has_include(MACRO)``, and a call of a ``__has_include`` wrapper such as CCCL's
``_CCCL_HAS_INCLUDE(<x>)`` on an ``#if``/``#elif``/``#define`` line) is resolved by
:class:`MacroTable` through every definition of the macro the scan has seen
(object-like, nested, ``-D``): all of them count. One it cannot resolve (a
function-like macro, ``##``, past ``MAX_EXPANSION_DEPTH`` / ``MAX_EXPANSIONS``) is
left to the scan's directory walk.
"""

from __future__ import annotations

import re

__all__ = [
    "ANGLE",
    "CALL",
    "COMPUTED",
    "DEFINE",
    "HAS_WRAPPER",
    "MAX_EXPANSIONS",
    "MAX_EXPANSION_DEPTH",
    "PRE_INCLUDE",
    "QUOTE",
    "WRAPS",
    "MacroTable",
    "names_no_file",
    "parse_includes",
]

#: What :func:`parse_includes` returns: ``(kind, spelling)`` pairs. An include by ``QUOTE`` or
#: ``ANGLE`` spelling, or a ``COMPUTED`` one whose spelling is the macro it names ("" when it is
#: no single identifier).
QUOTE, ANGLE, COMPUTED = 0, 1, 2
#: What the lexer records besides includes, so the scan can resolve macros as the preprocessor does:
#: an object-like ``#define`` ("NAME\nvalue"), a function-like macro wrapping ``__has_include`` of its
#: parameter ("NAME"), one calling another with its parameter ("NAME\nCALLEE"), and a call
#: ``IDENT(ARG)`` on an ``#if``/``#elif``/``#define`` line ("IDENT\nARG"), a ``__has_include``
#: through a wrapper when IDENT turns out to be one.
DEFINE, HAS_WRAPPER, WRAPS, CALL = 3, 4, 5, 6
#: A ``pre_include`` (``--pre-include``): looked up in the working directory, then on the include path.
PRE_INCLUDE = 7
_IDENT_RE = re.compile(r"[A-Za-z_$][\w$]*")
_IDENT_SPLIT_RE = re.compile(r"([A-Za-z_$][\w$]*)")
#: Bounds on resolving a computed include through definitions (past them it is unresolvable).
MAX_EXPANSION_DEPTH = 16
MAX_EXPANSIONS = 64

# The compiler finds directives after translation phases 1-3: line splices removed,
# comments replaced by one space, ``%:`` spelling ``#``. So does the lexer, on bytes,
# with regular expressions that skip the text between the few tokens that matter
# (newlines, comments, literals, ``#``). A spelling it cannot judge (a computed include,
# an unterminated comment or raw string) adds a ``COMPUTED`` entry: digest more.

_ID_CHAR = rb"[\w$\x80-\xff]"
_NOT_AFTER_ID = rb"(?<![\w$\x80-\xff])"
_WS_OR_COMMENT = rb"(?:[ \t\f\v\r\0]|/\*.*?\*/)*"
_TOKEN_RE = re.compile(
    rb"(?=[/\"'#%0-9.uULR_i])"  # the first bytes of the tokens below: fails fast everywhere else
    rb"(?:(?P<bc>/\*)"
    rb"|(?P<lc>//[^\n]*)"
    rb'|(?P<raw>' + _NOT_AFTER_ID + rb'(?:u8|u|U|L)?R"(?P<delim>[^ ()\\\t\v\f\n"]{0,16})\()'
    rb'|(?P<str>"(?:[^"\\\n]|\\.)*"?)'
    rb"|(?P<chr>'(?:[^'\\\n]|\\.)*'?)"
    # only a number with a digit separator matters (its ``'`` opens no character literal)
    rb"|(?P<num>" + _NOT_AFTER_ID + rb"\.?[0-9](?:[eEpP][+-]|[\w$\x80-\xff.])*'" + _ID_CHAR
    + rb"(?:[eEpP][+-]|'" + _ID_CHAR + rb"|[\w$\x80-\xff.])*)"
    rb"|(?P<hash>\#|%:)"
    rb"|(?P<has>" + _NOT_AFTER_ID + rb"__has_(?:include(?:_next)?|embed)(?!" + _ID_CHAR + rb"))"
    rb"|(?P<imp>" + _NOT_AFTER_ID + rb"import(?!" + _ID_CHAR + rb")))"
)
#: :data:`_TOKEN_RE` without the four tokens that begin with a letter or a digit (raw strings, numbers with
#: a digit separator, ``__has_include``, ``import``), for a text none of them can occur in
#: (:func:`_needs_every_token`): there both find the same tokens. It opens with the bytes tokens begin
#: with, not a lookahead, so the regex engine skips between them in C: the lexer reads a header about
#: three times faster.
_PUNCT_TOKEN_RE = re.compile(
    rb"[/\"'#%]"
    rb"(?:(?<=/)(?P<bc>\*)"
    rb"|(?<=/)(?P<lc>/[^\n]*)"
    rb'|(?<=")(?P<str>(?:[^"\\\n]|\\.)*"?)'
    rb"|(?<=')(?P<chr>(?:[^'\\\n]|\\.)*'?)"
    rb"|(?P<hash>(?<=\#)|(?<=%):))"
)
#: What each of those four tokens holds, found by a search that skips in C: ``R"`` (checked by
#: :func:`_raw_string_can_open`), ``__has_``, ``import`` as a word, and ``'`` before an identifier byte
#: (checked by :func:`_digit_separator_can_follow`).
_IMPORT_WORD_RE = re.compile(rb"import(?!" + _ID_CHAR + rb")(?<!" + _ID_CHAR + rb"import)")
_QUOTE_BEFORE_ID_RE = re.compile(rb"'" + _ID_CHAR)
_ID_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_$") | frozenset(range(0x80, 0x100))
_NUMBER_BYTES = _ID_BYTES | frozenset(b".")
_DIGITS = frozenset(b"0123456789")
_DIRECTIVE_NAME_RE = re.compile(
    _WS_OR_COMMENT + rb"(?P<name>include_next|include|import|embed|define|undef|elif|if)(?!" + _ID_CHAR + rb")"
    + _WS_OR_COMMENT,
    re.DOTALL,
)
_COMMENT_RE = re.compile(rb"/\*.*?\*/|//[^\n]*", re.DOTALL)
#: A single identifier and nothing else (a computed include naming one macro).
_LONE_NAME_RE = re.compile(rb"[ \t\f\v\r\0]*(?P<name>[A-Za-z_$\x80-\xff][\w$\x80-\xff]*)[ \t\f\v\r\0]*\Z")
#: ``NAME(a, b)`` right after ``#define``: a function-like macro's parameters.
_PARAMS_RE = re.compile(rb"\((?P<params>[^)\n]*)\)")
#: ``IDENT(<x>)``, ``IDENT("x")``, ``IDENT(ARG)`` on a directive line: a possible ``__has_include`` wrapper call.
_CALL_RE = re.compile(
    rb"(?<![\w$\x80-\xff])(?P<fn>[A-Za-z_][\w$]*)[ \t]*\([ \t]*"
    rb'(?:"(?P<q>[^"\n]*)"|<(?P<a>[^>\n]*)>|(?P<arg>[A-Za-z_][\w$]*))[ \t]*\)'
)
#: Longest ``#define`` value remembered for resolving computed includes.
_MAX_DEFINE_CHARS = 512
_MACRO_NAME_RE = re.compile(rb"[A-Za-z_$\x80-\xff][\w$\x80-\xff]*")
_HEADER_NAME_RE = re.compile(rb'"(?P<q>[^"\n]*)"|<(?P<a>[^>\n]*)>')
_HAS_ARG_RE = re.compile(_WS_OR_COMMENT + rb"\(" + _WS_OR_COMMENT, re.DOTALL)
_SKIP_RE = re.compile(_WS_OR_COMMENT, re.DOTALL)
_LINE_WS = b" \t\f\v\r\0"
_TRIGRAPHS = {b"=": b"#", b"/": b"\\", b"'": b"^", b"(": b"[", b")": b"]", b"!": b"|", b"<": b"{", b">": b"}", b"-": b"~"}
_TRIGRAPH_RE = re.compile(rb"\?\?([=/'()!<>-])")
_LENIENT_SPLICE_RE = re.compile(rb"\\[ \t\f\v]+(?=\r\n|\n|\r)")
_SPLICE_HINT_RE = re.compile(r"\\[ \t\f\v]*[\r\n]")


def _phases_1_2(data: bytes, *, trigraphs: bool, lenient_splice: bool, cr_newline: bool) -> bytes:
    """One reading of the bytes as the compiler may take them: newlines, trigraphs, splices."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if trigraphs:
        data = _TRIGRAPH_RE.sub(lambda m: _TRIGRAPHS[m.group(1)], data)
    if lenient_splice:
        data = _LENIENT_SPLICE_RE.sub(b"\\\\", data)
    data = data.replace(b"\r\n", b"\n")
    if cr_newline:
        data = data.replace(b"\r", b"\n")
    return data.replace(b"\\\n", b"")


def _needs_every_token(text: bytes) -> bool:
    """False when no token :data:`_PUNCT_TOKEN_RE` leaves out can occur in ``text`` (each needs what is checked)."""
    return (b"__has_" in text or _IMPORT_WORD_RE.search(text) is not None or _raw_string_can_open(text)
            or _digit_separator_can_follow(text))


def _raw_string_can_open(text: bytes) -> bool:
    """An ``R"`` whose prefix (``R``, ``uR``, ``UR``, ``LR``, ``u8R``) follows no identifier byte?"""
    at = text.find(b'R"')
    while at >= 0:
        for prefix in (0, 1, 2):
            start = at - prefix
            if start < 0 or (prefix == 1 and text[start] not in b"uUL") or (prefix == 2 and text[start:at] != b"u8"):
                continue
            if start == 0 or text[start - 1] not in _ID_BYTES:
                return True
        at = text.find(b'R"', at + 1)
    return False


def _digit_separator_can_follow(text: bytes) -> bool:
    """A ``'`` before an identifier byte, after a run of number bytes (``[eEpP][+-]`` included) that holds a digit?"""
    for quote in _QUOTE_BEFORE_ID_RE.finditer(text):
        at = quote.start() - 1
        while at >= 0:
            byte = text[at]
            if byte in _DIGITS:
                return True
            if byte in _NUMBER_BYTES:
                at -= 1
            elif byte in b"+-" and at > 0 and text[at - 1] in b"eEpP":
                at -= 2
            else:
                break
    return False


def _scan_directives(text: bytes) -> list[tuple[int, str]]:
    """The includes one reading of ``text`` names, in order; ``COMPUTED`` where it cannot tell."""
    found: list[tuple[int, str]] = []

    def line_end(at: int) -> int:
        end = text.find(b"\n", at)
        return len(text) if end < 0 else end

    def header(kind_pos: int) -> int:
        m = _HEADER_NAME_RE.match(text, kind_pos)
        if m is None:
            end = line_end(kind_pos)
            operand = _COMMENT_RE.sub(b" ", text[kind_pos:end])
            lone = _LONE_NAME_RE.match(operand)
            # ``#include MACRO``: resolved through the scan's definitions; anything else: the directories count
            found.append((COMPUTED, lone.group("name").decode("utf-8", "surrogateescape") if lone else ""))
            return kind_pos
        quoted = m.group("q")
        if quoted is not None:
            found.append((QUOTE, quoted.decode("utf-8", "surrogateescape")))
        else:
            found.append((ANGLE, m.group("a").decode("utf-8", "surrogateescape")))
        return m.end()

    def calls(start_at: int, end: int, params: frozenset[str] | None, macro: str) -> None:
        """Record each ``IDENT(<x>)`` / ``IDENT("x")`` / ``IDENT(ARG)`` call between ``start_at`` and ``end``."""
        for call in _CALL_RE.finditer(text, start_at, end):
            fn = call.group("fn")
            if fn in (b"defined", b"__has_include", b"__has_include_next", b"__has_embed"):
                continue  # ``defined(X)`` reads nothing; ``__has_include`` is a token of its own
            fn_name = fn.decode("utf-8", "surrogateescape")
            if call.group("q") is not None:
                found.append((QUOTE, call.group("q").decode("utf-8", "surrogateescape")))
            elif call.group("a") is not None:
                found.append((ANGLE, call.group("a").decode("utf-8", "surrogateescape")))
            else:
                arg = call.group("arg").decode("utf-8", "surrogateescape")
                if params is not None and arg in params:
                    found.append((WRAPS, f"{macro}\n{fn_name}"))
                else:
                    found.append((CALL, f"{fn_name}\n{arg}"))

    def define(at: int) -> tuple[int, int, frozenset[str] | None]:
        """Record a ``#define``: an object-like one's value, a function-like one's calls. Returns
        (where to scan on, where the directive ends, its parameters or None)."""
        nonlocal define_name
        macro_m = _MACRO_NAME_RE.match(text, at)
        if macro_m is None:
            return at, -1, None
        end = line_end(macro_m.end())
        define_name = macro_m.group().decode("utf-8", "surrogateescape")
        params_m = _PARAMS_RE.match(text, macro_m.end())
        if params_m is not None:  # function-like: ``(`` right after the name
            params = frozenset(p.strip().decode("utf-8", "surrogateescape")
                               for p in params_m.group("params").split(b","))
            calls(params_m.end(), end, params, define_name)
            return macro_m.end(), end, params
        value = _COMMENT_RE.sub(b" ", text[macro_m.end():end]).strip(_LINE_WS)
        if len(value) <= _MAX_DEFINE_CHARS:
            found.append((DEFINE, define_name + "\n" + value.decode("utf-8", "surrogateescape")))
        calls(macro_m.end(), end, None, define_name)
        return macro_m.end(), end, None

    define_name = ""
    define_end = -1  # where the ``#define`` being read ends (its body's tokens lie before it)
    define_params: frozenset[str] | None = None
    pos = 0
    clean = True  # nothing but whitespace and comments between the last line start and ``pos``
    search = (_TOKEN_RE if _needs_every_token(text) else _PUNCT_TOKEN_RE).search
    rfind = text.rfind

    def line_start_before(start: int) -> bool:
        """Only whitespace and comments between the start of the line and ``start``?"""
        newline = rfind(b"\n", pos, start)
        if newline >= 0:
            return not text[newline + 1 : start].strip(_LINE_WS)
        return clean and not text[pos:start].strip(_LINE_WS)

    while True:
        m = search(text, pos)
        if m is None:
            return found
        start = m.start()
        kind = m.lastgroup
        at_line_start = line_start_before(start) if kind in ("bc", "hash") else False
        pos = m.end()
        clean = False
        if kind == "bc":
            clean = at_line_start  # a comment is one space: the line is as clean after it as before
            end = text.find(b"*/", pos)
            if end < 0:
                found.append((COMPUTED, ""))  # unterminated comment: cannot tell what it hides
                return found
            pos = end + 2
        elif kind == "raw":
            close = b")" + m.group("delim") + b'"'
            end = text.find(close, pos)
            if end < 0:
                found.append((COMPUTED, ""))
                return found
            pos = end + len(close)
        elif kind == "hash":
            if at_line_start:
                d = _DIRECTIVE_NAME_RE.match(text, pos)
                if d is not None:
                    name = d.group("name")
                    if name == b"define":
                        pos, define_end, define_params = define(d.end())
                    elif name == b"undef":
                        macro = _MACRO_NAME_RE.match(text, d.end())
                        pos = macro.end() if macro is not None else d.end()
                    elif name in (b"if", b"elif"):
                        calls(d.end(), line_end(d.end()), None, b"")
                        pos = d.end()
                    else:
                        pos = header(d.end())
            clean = False
        elif kind == "has":
            arg = _HAS_ARG_RE.match(text, pos)
            if arg is not None:
                lone = _MACRO_NAME_RE.match(text, arg.end())
                if lone is not None and _HEADER_NAME_RE.match(text, arg.end()) is None:
                    ident = lone.group().decode("utf-8", "surrogateescape")
                    if start < define_end and define_params is not None and ident in define_params:
                        found.append((HAS_WRAPPER, define_name))  # ``#define W(x) __has_include(x)``
                    else:
                        found.append((COMPUTED, ident))  # ``__has_include(MACRO)``
                    pos = lone.end()
                else:
                    pos = header(arg.end())
            clean = False
        elif kind == "imp":
            # C++20 header units (``import <x.h>;``); a named module (``import m;``) reads no header.
            rest = _SKIP_RE.match(text, pos)
            after = rest.end() if rest is not None else pos
            if _HEADER_NAME_RE.match(text, after) is not None:
                pos = header(after)
            clean = False
        else:  # a string, character or number literal
            clean = False


def parse_includes(data: bytes) -> tuple[tuple[int, str], ...]:
    """Every include any reading of ``data`` the compiler may take names (a union: digest more, never less)."""
    toggles = []
    if b"??" in data and _TRIGRAPH_RE.search(data):
        toggles.append("trigraphs")
    if _LENIENT_SPLICE_RE.search(data):
        toggles.append("lenient_splice")
    if b"\r" in data.replace(b"\r\n", b""):
        toggles.append("cr_newline")
    found: dict[tuple[int, str], None] = {}
    for mask in range(1 << len(toggles)):
        flags = {name: bool(mask >> i & 1) for i, name in enumerate(toggles)}
        text = _phases_1_2(
            data,
            trigraphs=flags.get("trigraphs", False),
            lenient_splice=flags.get("lenient_splice", False),
            cr_newline=flags.get("cr_newline", True),
        )
        found.update(dict.fromkeys(_scan_directives(text)))
    return tuple(found)


def names_no_file(source: str) -> bool:
    """True when no directive of ``source`` can read a file, however spelled: the common case, kept cheap."""
    return ("include" not in source and "import" not in source and "embed" not in source and "??" not in source
            and ("\\" not in source or not _SPLICE_HINT_RE.search(source)))


class MacroTable:
    """The macro facts one scan has seen (its files' ``DEFINE``/``HAS_WRAPPER``/``WRAPS`` entries, ``-D``),
    and what a computed include expands to through them. One per scan; not thread-safe."""

    def __init__(self) -> None:
        self.defines: dict[str, set[str]] = {}  # object-like macros seen: name -> every value
        self.wrappers: set[str] = set()  # function-like macros that are ``__has_include`` of a parameter
        self.wraps: set[tuple[str, str]] = set()  # (macro, macro it calls with its parameter)

    def define(self, name: str, value: str) -> None:
        """One more definition of ``name`` (every one counts: ``#if`` is not evaluated)."""
        self.defines.setdefault(name, set()).add(value)

    def close_wrappers(self) -> None:
        """A macro calling a ``__has_include`` wrapper with its parameter is one too."""
        grown = True
        while grown:
            grown = False
            for macro, callee in self.wraps:
                if callee in self.wrappers and macro not in self.wrappers:
                    self.wrappers.add(macro)
                    grown = True

    def expand(self, name: str) -> set[tuple[int, str]] | None:
        """Every header name ``#include name`` can expand to, by every definition the scan has seen;
        None when one of them cannot be read (a function-like macro, ``##``, too many readings)."""
        out: set[tuple[int, str]] = set()
        stack = [(name, 0)]
        while stack:
            current, depth = stack.pop()
            values = self.defines.get(current)
            if not values or depth > MAX_EXPANSION_DEPTH:
                return None
            for value in values:
                if value.startswith('"') and value.endswith('"') and len(value) >= 2 and '"' not in value[1:-1]:
                    out.add((QUOTE, value[1:-1]))
                elif value.startswith("<") and value.endswith(">") and ">" not in value[1:-1]:
                    texts = self.expand_text(value[1:-1].strip(), depth)
                    if texts is None:
                        return None
                    out.update((ANGLE, t) for t in texts)
                elif _IDENT_RE.fullmatch(value):
                    stack.append((value, depth + 1))
                else:
                    return None
            if len(out) > MAX_EXPANSIONS:
                return None
        return out

    def expand_text(self, text: str, depth: int) -> set[str] | None:
        """``text`` with each identifier defined as plain text replaced, or not (both are digested)."""
        readings = {""}
        for piece in _IDENT_SPLIT_RE.split(text):
            options = {piece}
            if _IDENT_RE.fullmatch(piece) and piece in self.defines and depth < MAX_EXPANSION_DEPTH:
                for value in self.defines[piece]:
                    if any(c in value for c in "\"<>#()"):
                        return None
                    inner = self.expand_text(value, depth + 1)
                    if inner is None:
                        return None
                    options.update(inner)
            readings = {r + o for r in readings for o in options}
            if len(readings) > MAX_EXPANSIONS:
                return None
        return readings
