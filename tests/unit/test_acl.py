"""The ACL users `astraflow redis acl` makes: passwords only hashed, every key pattern inside the run,
the observer read-only, and the password file's rules."""

from pathlib import Path

import pytest

from astraflow.errors import ConfigError
from astraflow.streams import acl, acl_users


def _key_patterns(rules) -> list[str]:
    return [w for r in rules for w in r.strip("()").split() if "~" in w]


def test_rules_hold_only_a_hash_of_the_password_and_only_the_runs_keys():
    for role in acl.ROLES:
        user = acl_users.acl_user("r1", role, "plain-pw")
        assert user.name == f"af-r1-{role}"
        assert "plain-pw" not in " ".join(user.command())
        keys = _key_patterns(user.rules)
        assert keys and all(r.split("~", 1)[1].startswith("af:{r1}:") for r in keys)
        assert "~*" not in user.rules and "+@all" not in " ".join(user.rules)


def test_the_observer_reads_only_and_only_raas_and_trainer_read_the_weight_secret():
    observer = acl_users.acl_user("r1", "observer", "pw")
    assert all(r.startswith("%R~") for r in _key_patterns(observer.rules))
    assert not {"+xadd", "+hset", "+set", "+del", "+evalsha", "+xack"} & set(" ".join(observer.rules).split())
    for role in acl.ROLES:
        assert (("get", "weights:secret") in acl.allowed(role)) == (role in ("raas", "trainer"))


WRITES = {"set", "hset", "hdel", "del", "hincrby", "hsetnx", "expire", "xadd", "xtrim", "unlink"}


def test_no_worker_may_write_the_run_identity_or_the_weight_secret():
    for role in acl.ROLES:
        for command, family in acl.allowed(role):
            if family in ("run", "weights:secret"):
                assert command not in WRITES, (role, command, family)
        assert {"run", "weights:secret"}.isdisjoint(acl.families(role, write=True))


def test_each_role_may_write_only_its_own_consumer_names():
    for role in acl.WORKERS:
        names = {f for f in acl.families(role, write=True) if f.startswith("name:")}
        assert names == {f"name:{role}:*"}


def test_the_raas_may_neither_trim_nor_remove_consumers_and_deletes_only_where_its_work_is():
    raas = acl.allowed("raas")
    assert {f for c, f in raas if c in ("xtrim", "xgroup|delconsumer", "xsetid", "xdel")} == set()
    assert {f for c, f in raas if c == "xgroup|create"} == {"prompts"}
    assert {f for c, f in raas if c == "del"} == {"raas:*", "name:raas:*", "weights:*:*:relay:*:*:*"}
    assert {f for c, f in raas if c == "set"} == {
        "dedup:rollout:*",
        "name:raas:*",
        "weights:*:*:relay:*:*:*",
    }
    assert not {f for c, f in raas if c == "hset"} - {"raas:*", "errors"}


def test_the_raas_may_write_no_dead_letter_ledger_count_or_in_flight_group():
    """The dataflow dead-letters a RaaS's failed prompts (`streams.reap`): a RaaS credential can neither
    forge a dead letter, inflate the ledger nor drop a group from `in_flight`, by hand or through a
    function (FCALL needs write access to every key it hands)."""
    settled = {"dead", "ledger", "in_flight", "dedup:dead:*"}
    assert settled.isdisjoint(acl.families("raas", write=True))
    assert settled.isdisjoint(acl.script_families("raas"))
    assert {f for _, f in acl.allowed("raas")} & settled == {"ledger"}  # (read only: the start checks)
    for role in ("dataflow", "trainer"):  # (they still dead-letter what they consume)
        assert {"dead", "ledger", "in_flight"} <= acl.script_families(role)


def test_the_dataflow_deletes_no_stream():
    deletes = {f for c, f in acl.allowed("dataflow") if c in ("del", "unlink")}
    assert deletes == {"trace:*", "name:dataflow:*", "run:stop"}  # (a resumed run's stop notice)


def test_the_role_table_in_the_docs_is_the_acl_s(tmp_path):
    doc = Path(__file__).parents[2] / "docs" / "security.md"
    copy = tmp_path / "security.md"
    copy.write_text(doc.read_text())
    assert not acl.write_table(copy), "docs/security.md's role table is stale: regenerate it (see the doc)"
    assert "| raas | rollouts (hand-off) | `rollouts` | xadd type |" in acl.role_table()


def test_passwords_are_generated_into_a_private_file_then_read_back(tmp_path):
    path = tmp_path / "run.pw"
    made, new = acl_users.passwords(path)
    assert new and path.stat().st_mode & 0o777 == 0o600
    again, new = acl_users.passwords(path)
    assert again == made and not new
    path.write_text("raas=a\ntrainer=b\n")
    with pytest.raises(ConfigError, match="dataflow, observer"):
        acl_users.passwords(path)


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="unknown role"):
        acl_users.acl_user("r1", "admin", "pw")


def test_a_per_raas_user_holds_only_its_own_name_and_heartbeat():
    assert acl_users.accounts() == acl.ROLES
    labels = acl_users.accounts(("raas-0", "raas-1"))
    assert labels == ("raas/raas-0", "raas/raas-1", "dataflow", "trainer", "observer")
    user = acl_users.acl_user("r1", "raas/raas-0", "pw")
    assert user.name == "af-r1-raas-raas-0"
    keys = set(_key_patterns(user.rules))
    assert {"~af:{r1}:name:raas:raas-0", "~af:{r1}:raas:raas-0"} <= keys
    assert not {"~af:{r1}:name:raas:*", "~af:{r1}:raas:*"} & keys
    shared = acl_users.acl_user("r1", "raas", "pw")
    assert "~af:{r1}:name:raas:*" in _key_patterns(shared.rules)  # (one shared)
    for bad in ("raas-*", "a b", "x]"):
        with pytest.raises(ConfigError, match="RaaS id"):
            acl_users.accounts((bad,))
    with pytest.raises(ValueError, match="unknown role"):
        acl_users.acl_user("r1", "trainer:t0", "pw")


async def test_the_acl_command_makes_one_user_and_password_per_raas_id(tmp_path, capsys):
    from astraflow.config import Settings

    settings = Settings()
    settings.run.name = "r1"
    assert await acl_users.command(settings, None, tmp_path / "r1.pw", ("raas-0", "raas-1")) == 0
    out = capsys.readouterr().out
    assert out.count("ACL SETUSER af-r1-raas-raas-") == 2 and "ACL SETUSER af-r1-raas " not in out
    assert sorted(line.split("=")[0] for line in (tmp_path / "r1.pw").read_text().splitlines()) == [
        "dataflow",
        "observer",
        "raas/raas-0",
        "raas/raas-1",
        "trainer",
    ]
