"""A request's output constraint compiled by xgrammar, without torch: the front-ends' check (a bad schema, regex
or grammar is refused with a 400 before the request reaches the engine) and the worker's compiler
(testbed/worker/grammar.py, which adds the matchers and the torch bitmask) share this one translation of
StructuredOutputsParams into an xgrammar grammar and its one error message. Nothing here imports torch (xgrammar
itself may, as its package does today)."""
from __future__ import annotations

import re
from typing import Sequence

from testbed.engine.params import InvalidParam, StructuredOutputsParams

_XGR_LOCATION = re.compile(r"\[[^\]]*\] \S+?:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def xgrammar():
    """The xgrammar module, or a RuntimeError saying how to install it."""
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency: the `real` extra installs it
        raise RuntimeError("structured outputs need the xgrammar package: pip install xgrammar") from e
    return xgrammar


def _reason(e: Exception) -> str:
    return _XGR_LOCATION.sub("", str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (quotes, backslashes and control characters escaped)."""
    def literal(s: str) -> str:
        out = []
        for ch in s:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 32 or ord(ch) == 127:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


def compile_constraint(so: StructuredOutputsParams, compiler=None):
    """The constraint as an xgrammar Grammar (compiler None: no tokenizer needed) or a CompiledGrammar of
    `compiler`; InvalidParam (naming structured_outputs.<kind>) when it does not compile."""
    xgr = xgrammar()
    kind, spec, ws = so.kind, so.spec, not so.disable_any_whitespace
    if compiler is None:
        g = xgr.Grammar
        build = {"json": lambda: g.from_json_schema(spec, any_whitespace=ws),
                 "json_object": lambda: g.builtin_json_grammar(),
                 "regex": lambda: g.from_regex(spec),
                 "grammar": lambda: g.from_ebnf(spec),
                 "choice": lambda: g.from_ebnf(choice_grammar(spec))}
    else:
        c = compiler
        build = {"json": lambda: c.compile_json_schema(spec, any_whitespace=ws),
                 "json_object": lambda: c.compile_builtin_json_grammar(),
                 "regex": lambda: c.compile_regex(spec),
                 "grammar": lambda: c.compile_grammar(spec),
                 "choice": lambda: c.compile_grammar(choice_grammar(spec))}
    try:
        return build[kind]()
    except Exception as e:  # noqa: BLE001 - xgrammar reports every parse error as RuntimeError or ValueError
        raise InvalidParam(f"structured_outputs.{kind}", f"does not compile: {_reason(e)}") from None


def check_structured_outputs(so: StructuredOutputsParams) -> None:
    """InvalidParam (naming structured_outputs.<kind>) when the constraint does not compile."""
    compile_constraint(so)
