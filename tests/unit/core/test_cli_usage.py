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
