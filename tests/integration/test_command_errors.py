"""A command's failure against a real Redis is one line on stderr and exit 1: a wrong password (at once:
it is no outage to wait out, also for a RaaS and a liveness probe), a user the ACL refuses, a run that
is not there."""

import secrets
from urllib.parse import urlsplit

import pytest
import redis

from astraflow.cli import main

pytestmark = pytest.mark.integration


def url_file(tmp_path, url: str, password: str | None = None):
    """A --redis-file with `url`, its password replaced by `password` when given."""
    if password is not None:
        parts = urlsplit(url)
        url = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", f":{password}@")).geturl()
    path = tmp_path / "redis-url"
    path.write_text(url)
    return str(path)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "command", [["ledger"], ["inspect"], ["top"], ["clear", "--yes"], ["raas"], ["dataflow"]], ids=str
)
def test_a_wrong_password_is_one_line_and_exit_1_not_an_outage(redis_url, tmp_path, capsys, command):
    """The worker commands included: a RaaS used to retry it for 60 s, then say "redis unreachable"."""
    wrong = secrets.token_hex(8)
    assert main([*command, "--run", "r", "--redis-file", url_file(tmp_path, redis_url, wrong)]) == 1
    err = one_line_error(capsys)
    assert err.startswith("astraflow: Redis refused the credentials: invalid username-password pair"), err
    assert "unreachable" not in err and wrong not in err


def test_a_liveness_probe_with_a_wrong_password_fails(redis_url, tmp_path, capsys):
    """It used to pass ("not judged: the worker waits Redis out"): no wait fixes a password."""
    args = ["health", "--role", "raas", "--live", "--redis-file", url_file(tmp_path, redis_url, "nope")]
    assert main(args) == 1
    assert capsys.readouterr().out.startswith("unhealthy: Redis refused the credentials")


def test_a_user_the_acl_refuses_is_told_so(redis_url, tmp_path, capsys):
    admin = redis.Redis.from_url(redis_url)
    user, password = f"u{secrets.token_hex(4)}", secrets.token_hex(8)
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+ping"])
    try:
        parts = urlsplit(redis_url)
        url = parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}").geturl()
        assert main(["ledger", "--run", "r", "--redis-file", url_file(tmp_path, url)]) == 1
        err = one_line_error(capsys)
        assert err.startswith("astraflow: Redis refused a command to this user: "), err
        assert "astraflow redis acl" in err
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_an_unknown_run_is_named(redis_url, tmp_path, capsys):
    redis.Redis.from_url(redis_url).hset("af:{there}:run", mapping={"nonce": "n", "created": "1"})
    for command in (["ledger"], ["trace", "u1"], ["top"]):
        assert main([*command, "--run", "nowhere", "--redis-file", url_file(tmp_path, redis_url)]) == 1
        err = one_line_error(capsys)
        assert (
            err == "astraflow: no run 'nowhere' on this Redis (runs there: there): name one with --run NAME\n"
        )


def test_a_dataset_that_does_not_parse_is_one_line_naming_file_and_row(redis_url, tmp_path, capsys):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "1+1="}\nnot json\n')
    dataset = f"dataflow.dataset={{type: jsonl, path: {bad}}}"
    assert (
        main(["dataflow", "--run", "d", "--redis-file", url_file(tmp_path, redis_url), "--set", dataset]) == 1
    )
    err = one_line_error(capsys)
    assert err.startswith(f"astraflow: ValueError: {bad}:2: not JSON"), err
    assert err.endswith("(--debug shows the traceback)\n")
    assert not redis.Redis.from_url(redis_url).exists("af:{d}:run")  # the failed start left no run behind
