"""Every option of every aio command line says what it does and its
default, as a new user reads ``--help``."""

import argparse
import importlib

import pytest

from aio._cli import DefaultsFormatter

CLIS = {
    "aio-train": "aio.train",
    "aio-sweep": "aio.sweep",
    "aio-check": "aio.quickcheck",
    "aio-config": "aio.config.__main__",
    "aio-export": "aio.zero.export_cli",
    "aio-train --nproc": "aio.fsdp.train",
}
_FLAGS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._HelpAction,
)


def _actions(parser, name):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, p in a.choices.items():
                yield from _actions(p, f"{name} {sub}")
        else:
            yield parser, name, a


@pytest.mark.parametrize("prog", sorted(CLIS))
def test_every_option_has_help_and_its_default(prog):
    parser = importlib.import_module(CLIS[prog]).build_parser()
    for p, name, a in _actions(parser, prog):
        assert a.help, f"{name} {a.option_strings or a.dest}: no help text"
        formatter = p._get_formatter()
        assert isinstance(formatter, DefaultsFormatter), name
        text = formatter._get_help_string(a)
        if a.option_strings and not isinstance(a, _FLAGS) and a.default is not None:
            assert "default" in text, f"{name} {a.option_strings}: its default is not shown"
    assert "(default: 10)" in importlib.import_module("aio.train").build_parser().format_help()
