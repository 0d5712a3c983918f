"""Reading rendered C for people: cut out one entry point with what it uses, and diff two builds.

`convgen show --op forward` prints the forward kernel without the backward ones. The rendered
module is split into its top-level items (preprocessor lines, type and enum declarations,
functions, each with the comments just above it); an entry point is then printed with every item
it reaches through the names it mentions (functions it calls, macros, types), in source order. The
result is a C file that still compiles on its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_ALWAYS_KEPT = ("include", "if", "ifdef", "ifndef", "elif", "else", "endif", "pragma", "undef", "error")


@dataclasses.dataclass(frozen=True)
class Item:
    """One top-level piece of a C file: its text (with the comments above it) and the names it defines."""

    text: str
    names: frozenset[str]
    uses: frozenset[str]
    always: bool  # kept in every extract: #include and conditional lines


def _code_only(text: str) -> str:
    """`text` with comments, string and character literals blanked out (line breaks kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two == "/*":
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif two == "//":
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _strip_attributes(code: str) -> str:
    """`code` without its __attribute__((...)) clauses (balanced parentheses)."""
    while True:
        at = code.find("__attribute__")
        if at < 0:
            return code
        i = code.find("(", at)
        if i < 0:
            return code[:at]
        depth = 0
        for j in range(i, len(code)):
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            if depth == 0:
                break
        code = code[:at] + " " + code[j + 1:]


def _defined_names(code: str, is_function: bool) -> set[str]:
    """The names one declaration or function defines (its code, with comments already blanked)."""
    code = _strip_attributes(code)
    if is_function:
        head = code[:code.index("(")]
        return set(_IDENTIFIER.findall(head)[-1:])
    names = set()
    head = code.split("=", 1)[0]
    if "{" in head and re.match(r"\s*(typedef\s+)?(struct|union|enum)\b", code):
        body = code[code.index("{") + 1:code.rindex("}")]
        if re.match(r"\s*(typedef\s+)?enum\b", code):
            names |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=[^,}]*)?(?:,|$)", body.strip()))
        tail = code[code.rindex("}") + 1:]
        names |= set(_IDENTIFIER.findall(tail))
        tag = re.match(r"\s*(?:typedef\s+)?(?:struct|union|enum)\s+([A-Za-z_]\w*)", code)
        if tag:
            names.add(tag.group(1))
    elif re.search(r"\(\s*\*\s*[A-Za-z_]\w*\s*\)", code):
        # A function pointer: typedef int (*name)(...); or int (*name)(...) = ...;
        names.add(re.search(r"\(\s*\*\s*([A-Za-z_]\w*)\s*\)", code).group(1))
    elif re.match(r"\s*typedef\b", code) and "(" in head:
        # A function type: typedef int name(...);
        names |= set(_IDENTIFIER.findall(head[:head.index("(")])[-1:])
    else:
        # A plain declaration: the last name before any initializer, array bound or the semicolon.
        head = re.split(r"[=\[;]", code, maxsplit=1)[0]
        names |= set(_IDENTIFIER.findall(head)[-1:])
    return names


def top_level_items(source: str) -> list[Item]:
    """Split a C file into its top-level items, in order; comments go with the item below them."""
    code = _code_only(source)
    items = []
    start = i = depth = 0
    n = len(code)
    line_start = True
    while i < n:
        ch = code[i]
        if depth == 0 and line_start and ch == "#":
            end = i
            while True:  # a directive runs to the end of its line, continued by a trailing backslash
                end = code.find("\n", end)
                if end < 0:
                    end = n
                    break
                if code[end - 1] != "\\":
                    break
                end += 1
            directive = re.match(r"#\s*(\w+)", code[i:end]).group(1)
            names, uses = set(), set()
            macro = re.match(r"#\s*define\s+([A-Za-z_]\w*)(\([^)]*\))?(.*)", code[i:end], re.S)
            if macro:
                names = {macro.group(1)}
                uses = set(_IDENTIFIER.findall(macro.group(3))) - names
            items.append(Item(source[start:end], frozenset(names), frozenset(uses), directive in _ALWAYS_KEPT))
            start = i = end
            continue
        if ch == "\n":
            line_start = True
        elif not ch.isspace():
            line_start = False
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                item_code = code[start:i + 1]
                head = _strip_attributes(item_code[:item_code.index("{")])
                is_function = "(" in head and not re.match(r"\s*(typedef|struct|enum|union)\b", head)
                if is_function:
                    items.append(_item(source[start:i + 1], item_code, True))
                    start = i + 1
        elif ch == ";" and depth == 0:
            items.append(_item(source[start:i + 1], code[start:i + 1], False))
            start = i + 1
        i += 1
    return items


def _item(text: str, code: str, is_function: bool) -> Item:
    names = _defined_names(code, is_function)
    return Item(text, frozenset(names), frozenset(_IDENTIFIER.findall(code)) - names, False)


def extract(source: str, entry_points) -> str:
    """The entry points of `source` with every item they use, in source order, as compilable C.

    Raises ValueError if an entry point is not defined in `source`.
    """
    items = top_level_items(source)
    # Every item that defines a name: a macro defined in both branches of an #ifdef keeps both.
    by_name: dict = {}
    for item in items:
        for name in item.names:
            by_name.setdefault(name, []).append(item)
    wanted = list(entry_points)
    missing = [name for name in wanted if name not in by_name]
    if missing:
        raise ValueError(f"the rendered source defines no {', '.join(missing)}")
    kept, todo = set(), [item for name in wanted for item in by_name[name]]
    while todo:
        item = todo.pop()
        if id(item) in kept:
            continue
        kept.add(id(item))
        todo += [used for name in item.uses for used in by_name.get(name, ()) if id(used) not in kept]
    text = "".join(item.text for item in items if item.always or id(item) in kept)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


def unified_diff(before: str, after: str, before_name: str, after_name: str, context: int = 3) -> str:
    """A unified diff of two sources (empty when they are equal)."""
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=before_name, tofile=after_name, n=context))
