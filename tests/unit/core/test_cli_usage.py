"""Usage errors of `ferrum-rpc` name the command's own --help, in one line, exit status 2."""

from __future__ import annotations

import pytest

from ferrum_rpc.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("argv, command", [(["serve", "--bogus"], "serve"), (["generate", "--bogus", "hi"], "generate"),
                                           (["prepare", "--bogus"], "prepare"), (["generate"], "generate")])
def test_a_usage_error_names_the_commands_help(argv, command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"ferrum-rpc {command}: ") and err.rstrip().endswith(f"(see ferrum-rpc {command} --help)")


def test_the_docs_list_every_serve_flag_as_the_parser_has_it():
    """docs/server.md's flag table is the parser's own (regenerate it with
    ``python -m ferrum_rpc.cli --flags-markdown serve``)."""
    from pathlib import Path

    from ferrum_rpc.cli import flags_markdown

    text = (Path(__file__).resolve().parents[3] / "docs" / "server.md").read_text()
    table = text.split("<!-- flags:serve:begin -->\n", 1)[1].split("<!-- flags:serve:end -->", 1)[0]
    assert table == flags_markdown("serve")
