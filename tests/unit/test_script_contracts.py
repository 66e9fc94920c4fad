"""Each Lua script's keys and arguments are declared once, in its package's `scripts` module
(`streams.contract`): these tests fail when a script reads KEYS or ARGV itself, reads a key or argument its
contract does not declare, or leaves one declared unread; and when a curator's Lua half is not named after
a registered curator."""

from pathlib import Path

import pytest

import astraflow
from astraflow.dataflow import scripts as dataflow_scripts
from astraflow.dataflow.curators import CURATORS
from astraflow.streams import scripts as stream_scripts
from astraflow.streams.connection import script_source
from astraflow.streams.contract import Arg, Contract, Many, Pairs, declared, includes
from astraflow.weights import scripts as weight_scripts

pytestmark = pytest.mark.timeout(60)
ROOT = Path(astraflow.__file__).parent
PACKAGES = {"astraflow.streams": stream_scripts, "astraflow.dataflow": dataflow_scripts}
PACKAGES["astraflow.weights"] = weight_scripts
PRELUDES = {"astraflow.dataflow": "common.lua"}


def body(package: str, contract: Contract) -> str:
    lua = ROOT / package.split(".")[1] / "lua"
    return includes(contract, lua) + (lua / f"{contract.name}.lua").read_text()


def test_every_script_has_a_contract_and_keeps_it():
    for package, module in PACKAGES.items():
        files = {p.stem for p in (ROOT / package.split(".")[1] / "lua").glob("*.lua")} - {"common"}
        assert files == {c.name for c in module.CONTRACTS}, package
        for contract in module.CONTRACTS:
            contract.check(body(package, contract))
            script_source(contract.name, package, PRELUDES.get(package))  # (the schema's names resolve)


def test_no_lua_file_reads_keys_or_argv():
    offenders = [
        p.name for p in ROOT.glob("*/lua/**/*.lua") if "KEYS[" in p.read_text() or "ARGV[" in p.read_text()
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda t: t + "\nlocal x = ARGV[1]\n", "reads ARGV itself"),
        (lambda t: t + "\nlocal x = KEYS[1]\n", "reads KEYS itself"),
        (lambda t: t + "\nlocal x = Arg.bogus\n", "not in its contract"),
        (lambda t: t + "\nlocal x = Key.group\n", "not in its contract"),  # (an argument, not a key)
        (lambda t: t.replace("Arg.max_step", "1"), "never reads ['max_step']"),
    ],
)
def test_a_script_that_breaks_its_contract_fails(change, error):
    contract = declared("astraflow.dataflow", "version")
    with pytest.raises(ValueError, match=error.replace("[", r"\[")):
        contract.check(change(body("astraflow.dataflow", contract)))


def test_a_record_field_never_read_fails():
    contract = declared("astraflow.dataflow", "submit_eval")
    text = body("astraflow.dataflow", contract).replace("d.rows", "0")
    with pytest.raises(ValueError, match=r"never reads \['rows'\]"):
        contract.check(text)


def test_a_call_takes_exactly_the_declared_names():
    contract = Contract(
        "t", keys=("a",), args=(Arg("n", "int"), Many("items", (Arg("x"), Pairs("f")))), reply=""
    )
    keys, args = contract.call(a="k", n=3, items=[{"x": "1", "f": {"p": "q"}}, {"x": None, "f": {}}])
    assert (keys, args) == (["k"], [3, 2, "1", 1, "p", "q", "", 0])
    with pytest.raises(TypeError, match=r"wrong: \['m', 'n'\]"):
        contract.call(a="k", m=3, items=[])
    with pytest.raises(ValueError, match="declared twice"):
        Contract("t", keys=("a",), args=(Arg("a"),), reply="")


def test_each_curator_lua_half_is_named_after_a_registered_curator():
    halves = {p.stem for p in (ROOT / "dataflow" / "lua" / "curators").glob("*.lua")}
    assert halves <= set(CURATORS), halves - set(CURATORS)
    assert set(CURATORS) - halves <= {"accept_all"}  # (it keeps no state)
    for name in ("collect", "announce"):
        assert "curators" in declared("astraflow.dataflow", name).include
