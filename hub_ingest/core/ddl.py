"""A check of the Spark DDL in ``ingest.payload_schema`` when the config is read, without a
JVM: a misspelt type (``temp DOUBL``) would otherwise load and fail only once a Spark job
starts. Spark's own parser still has the last word; this catches what a typo makes.
"""

from __future__ import annotations

import re

# Spark SQL's type names (case-insensitive); parameterised ones take "(…)" after the name.
_SIMPLE = {
    "boolean", "tinyint", "byte", "smallint", "short", "int", "integer", "bigint", "long",
    "float", "real", "double", "string", "binary", "date", "timestamp", "timestamp_ntz",
    "timestamp_ltz", "variant", "void",
}  # fmt: skip
_PARAMETERISED = {"decimal", "dec", "numeric", "varchar", "char", "character"}
_TOKEN = re.compile(r"\s*(`[^`]+`|'[^']*'|[A-Za-z_][A-Za-z0-9_]*|\d+|[<>(),:])")


class DdlError(ValueError):
    pass


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[str] = []
        position = 0
        while position < len(text.rstrip()):
            match = _TOKEN.match(text, position)
            if match is None:
                raise DdlError(f"unexpected {text[position:].strip()[:20]!r}")
            self.tokens.append(match.group(1))
            position = match.end()
        self.at = 0

    def peek(self) -> str:
        return self.tokens[self.at] if self.at < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if not token or (expected is not None and token != expected):
            raise DdlError(f"expected {expected or 'more'}, got {token or 'the end'!r}")
        self.at += 1
        return token

    def fields(self, end: str, separator: str | None) -> None:
        """``name [:] TYPE [NOT NULL] [COMMENT '…'], …`` up to `end`."""
        while True:
            name = self.take()
            if not (name.startswith("`") or name[0].isalpha() or name[0] == "_"):
                raise DdlError(f"expected a column name, got {name!r}")
            if separator is not None and self.peek() == separator:
                self.take()
            self.type()
            if self.peek().lower() == "not":
                self.take()
                if self.take().lower() != "null":
                    raise DdlError("expected NULL after NOT")
            if self.peek().lower() == "comment":
                self.take()
                if not self.take().startswith("'"):
                    raise DdlError("expected a quoted text after COMMENT")
            if self.peek() != ",":
                break
            self.take(",")
        if self.peek() != end:
            raise DdlError(f"expected ',' or the end of the fields, got {self.peek()!r}")

    def type(self) -> None:
        name = self.take().lower()
        if name in _SIMPLE:
            return
        if name in _PARAMETERISED:
            if self.peek() == "(":
                self.take("(")
                while self.take() != ")":
                    pass
            return
        if name == "array":
            self.take("<")
            self.type()
            self.take(">")
        elif name == "map":
            self.take("<")
            self.type()
            self.take(",")
            self.type()
            self.take(">")
        elif name == "struct":
            self.take("<")
            self.fields(">", ":")
            self.take(">")
        else:
            raise DdlError(f"unknown type {name.upper()!r}")


def check_ddl(text: str) -> str:
    """`text` if it reads as Spark column DDL (``"temp DOUBLE, unit STRING"``)."""
    parser = _Parser(text)
    if not parser.tokens:
        raise DdlError("no columns")
    parser.fields("", None)
    return text
