"""The memory-traffic model: the paper's Table 1 figures, and the accounting's invariants."""

import pytest

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import traffic as tm  # noqa: E402


def _rows(**kwargs):
    return {row.variant: row for row in tm.traffic(**kwargs)}


def test_reproduces_the_paper_table_1():
    totals = tm.check_against_paper()
    assert totals["standard"] == 3.0
    assert totals["block_two_phase"] == 5.5
    assert round(totals["full_two_phase"]) == 24


def test_paper_setting_terms():
    rows = _rows(num_layers=128, num_blocks=8)
    assert (rows["standard"].reads, rows["standard"].writes) == (2, 1)
    assert (rows["block_two_phase"].reads, rows["block_two_phase"].writes) == (3.5, 2)
    assert rows["block_per_site"].total == 8 + 4          # N completed blocks + update + h
    assert rows["full_per_site"].total == 128 + 1
    strict = _rows(num_layers=128, num_blocks=8, strict=True)
    assert strict["block_two_phase"].total == 6.5          # phase 1's result write charged too


def test_cached_keys_save_no_traffic_only_scalars():
    rows = _rows(num_layers=24, block_size=3)
    assert rows["block_cached_keys"].total == rows["block_per_site"].total
    with_dim = _rows(num_layers=24, block_size=3, dim=512)
    extra = with_dim["block_cached_keys"].total - with_dim["block_per_site"].total
    assert 0 < extra < 0.05                                # a few scalars per token, in units of d


@pytest.mark.parametrize("layers, size", [(24, 2), (24, 3), (128, 16)])
def test_two_phase_reads_less_than_per_site_once_blocks_are_shared(layers, size):
    rows = _rows(num_layers=layers, block_size=size)
    assert rows["block_two_phase"].total < rows["block_per_site"].total
    assert rows["full_two_phase"].total < rows["full_per_site"].total
    assert rows["standard"].total < rows["block_two_phase"].total


def test_two_phase_does_not_pay_off_at_block_size_1():
    rows = _rows(num_layers=24, block_size=1)
    # One query per group: phase 1 re-reads what a per-site aggregation reads, plus its own result.
    assert rows["block_two_phase"].total == rows["block_per_site"].total + 1


def test_a_second_pass_over_the_sources_is_charged():
    one, two = _rows(num_layers=24, block_size=3), _rows(num_layers=24, block_size=3, passes=2)
    assert two["block_per_site"].reads == one["block_per_site"].reads + 8 + 1    # N blocks + partial
    assert two["standard"].total == one["standard"].total


def test_mean_is_below_the_last_layer_and_bytes_scale():
    row = _rows(num_layers=24, block_size=3)["block_per_site"]
    assert row.mean_total < row.total
    assert row.bytes_per_forward(1024, 512) == pytest.approx(row.mean_total * 24 * 1024 * 512 * 4)


def test_format_table_and_cli(capsys):
    table = tm.format_table(tm.traffic(24, block_size=3), tokens=1024, dim=512)
    assert table.count("\n") == 1 + len(tm.VARIANTS)
    for label in tm.VARIANTS.values():
        assert label in table
    assert "MB per forward" in table
    tm.main(["--layers", "128", "--blocks", "8"])
    out = capsys.readouterr().out
    assert "| Block AttnRes, two-phase | 3.50d | 2.00d | 5.50d |" in out


@pytest.mark.parametrize("kwargs", [{"num_layers": 0, "num_blocks": 8}, {"num_layers": 8},
                                    {"num_layers": 8, "block_size": 0}, {"num_layers": 8, "num_blocks": 2,
                                                                         "passes": 0}])
def test_rejects_bad_configs(kwargs):
    with pytest.raises(ValueError):
        tm.traffic(**kwargs)
