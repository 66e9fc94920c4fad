"""The ACL users `astraflow redis acl` makes: passwords only hashed, every key pattern inside the run,
the observer read-only, and the password file's rules."""

import pytest

from astraflow.errors import ConfigError
from astraflow.streams import acl


def test_rules_hold_only_a_hash_of_the_password_and_only_the_runs_keys():
    for role in acl.ROLES:
        user = acl.acl_user("r1", role, "plain-pw")
        assert user.name == f"af-r1-{role}"
        assert "plain-pw" not in " ".join(user.command())
        keys = [r for r in user.rules if "~" in r]
        assert keys and all(r.split("~", 1)[1].startswith("af:{r1}:") for r in keys)
        assert "~*" not in user.rules and "+@all" not in user.rules


def test_the_observer_reads_only_and_only_raas_and_trainer_see_the_weight_secret():
    observer = acl.acl_user("r1", "observer", "pw")
    assert all(r.startswith("%R~") for r in observer.rules if "~" in r)
    assert not {"+xadd", "+hset", "+set", "+del", "+evalsha", "+xack"} & set(observer.rules)
    secret = "af:{r1}:weights:secret"
    for role in acl.ROLES:
        rules = acl.acl_user("r1", role, "pw").rules
        assert (f"~{secret}" in rules) == (role in ("raas", "trainer"))


def test_passwords_are_generated_into_a_private_file_then_read_back(tmp_path):
    path = tmp_path / "run.pw"
    made, new = acl.passwords(path)
    assert new and path.stat().st_mode & 0o777 == 0o600
    again, new = acl.passwords(path)
    assert again == made and not new
    path.write_text("raas=a\ntrainer=b\n")
    with pytest.raises(ConfigError, match="dataflow, observer"):
        acl.passwords(path)


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="unknown role"):
        acl.acl_user("r1", "admin", "pw")
