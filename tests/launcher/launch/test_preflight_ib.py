"""IB sysfs checks on fixture trees written exactly as the kernel writes them."""

import pytest
from helpers.doubles import write_port

from training.preflight.ib_sysfs import check_ib, expected_hcas, parse_enum, parse_rate, snapshot
from training.preflight.report import FAIL, OK, WARN


@pytest.fixture
def dgx(tmp_path):
    root = str(tmp_path / "infiniband")
    for i in range(4):
        write_port(root, f"mlx5_{i}")
    return root


EXPECT = [(f"mlx5_{i}", None) for i in range(4)]


def statuses(checks, status=FAIL):
    return {(c.name, c.subject) for c in checks if c.status == status}


def test_kernel_formats():
    assert parse_enum("4: ACTIVE\n") == "ACTIVE" and parse_enum("5: LinkUp") == "LinkUp"
    assert parse_enum("2: Polling") == "Polling"
    assert parse_rate("400 Gb/sec (4X NDR)") == 400.0 and parse_rate("2.5 Gb/sec (1X SDR)") == 2.5
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_healthy_hcas_pass(dgx):
    checks = check_ib(dgx, EXPECT, 400, "n1")
    assert statuses(checks) == set() and statuses(checks, WARN) == set()
    assert {c.subject for c in checks if c.name == "ib.state"} == {f"mlx5_{i}/1" for i in range(4)}
    assert all(c.node == "n1" for c in checks)


def test_missing_hca(dgx):
    assert statuses(check_ib(dgx, EXPECT + [("mlx5_7", None)], 400, "n1")) == {("ib.present", "mlx5_7")}


def test_down_port(dgx):
    write_port(dgx, "mlx5_2", state="1: DOWN", phys="3: Disabled")
    assert statuses(check_ib(dgx, EXPECT, 400, "n1")) == {("ib.state", "mlx5_2/1"), ("ib.phys_state", "mlx5_2/1")}


def test_polling_phys_state(dgx):
    write_port(dgx, "mlx5_1", state="4: ACTIVE", phys="2: Polling")
    assert statuses(check_ib(dgx, EXPECT, 400, "n1")) == {("ib.phys_state", "mlx5_1/1")}


def test_wrong_rate(dgx):
    write_port(dgx, "mlx5_3", rate="200 Gb/sec (4X HDR)")
    checks = check_ib(dgx, EXPECT, 400, "n1")
    assert statuses(checks) == {("ib.rate", "mlx5_3/1")}
    assert statuses(check_ib(dgx, EXPECT, 0, "n1")) == set()  # 0 skips the rate check


def test_nonzero_counters_warn_rising_counters_fail(dgx):
    write_port(dgx, "mlx5_0", counters={"link_downed": 1, "symbol_error": 12})
    checks = check_ib(dgx, EXPECT, 400, "n1")
    assert statuses(checks) == set() and statuses(checks, WARN) == {("ib.errors", "mlx5_0/1")}
    before = snapshot(dgx)
    write_port(dgx, "mlx5_0", counters={"link_downed": 1, "symbol_error": 40, "port_rcv_errors": 3})
    checks = check_ib(dgx, EXPECT, 400, "n1", before=before)
    assert statuses(checks) == {("ib.errors", "mlx5_0/1")}
    bad = [c for c in checks if c.status == FAIL][0]
    assert bad.found == {"symbol_error": 28, "port_rcv_errors": 3}


def test_explicit_port_and_nccl_ib_hca_syntax(dgx):
    assert expected_hcas([], {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1"}) == [("mlx5_0", 1), ("mlx5_1", None)]
    assert expected_hcas([], {"NCCL_IB_HCA": "^mlx5_2"}) == []
    assert expected_hcas(["mlx5_5"], {"NCCL_IB_HCA": "mlx5_0"}) == [("mlx5_5", None)]
    assert statuses(check_ib(dgx, [("mlx5_0", 2)], 400, "n1")) == {("ib.present", "mlx5_0/2")}


def test_no_ib_stack_and_none_expected_is_ok(tmp_path):
    checks = check_ib(str(tmp_path / "absent"), [], 0, "n1")
    assert [(c.name, c.status) for c in checks] == [("ib.hcas", OK)]
    # ... but an expected HCA on a node without the IB stack fails.
    assert statuses(check_ib(str(tmp_path / "absent"), [("mlx5_0", None)], 0, "n1")) == {("ib.present", "mlx5_0")}
