"""``evenly audit --peer``: each installed peer's factory (its documented DDP recipe, in
``evenly.audit.peers``) runs under real ranks and workers on data written in its own
format, and delivers every sample once per epoch.  Peers that are not installed are
skipped (``bench/setup_peers.sh`` installs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evenly.audit import AuditError, AuditResult, audit_many
from evenly.audit.peers import PEERS, installed, peer_factory, write_peer_data

SIZE = 64
HERE = installed()


@pytest.fixture(scope="module")
def peer_audits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AuditResult]:
    data = tmp_path_factory.mktemp("peers")
    names = sorted(HERE)
    for name in names:
        write_peer_data(name, data, SIZE)
    results = audit_many(
        [peer_factory(n, data) for n in names], num_workers=2, world_size=2, batch_size=4
    )
    return dict(zip(names, results, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PEERS))
def test_a_peer_by_name_delivers_every_sample_once_per_epoch(
    name: str, peer_audits: dict[str, AuditResult]
) -> None:
    if name not in HERE:
        pytest.skip(f"{PEERS[name]} is not installed (bench/setup_peers.sh)")
    result = peer_audits[name]
    assert result.finding("missing").status == "PASS", result.findings
    assert result.finding("duplicates").status == "PASS", result.findings
    assert result.finding("rank_balance").status != "FAIL", result.findings


def test_an_unknown_peer_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(AuditError, match=r"unknown peer 'nope'; choose from \['evenly'"):
        peer_factory("nope", tmp_path)


def test_a_loader_that_counts_batches_by_their_length_counts_the_audits_batches_right() -> None:
    """MosaicML's StreamingDataLoader counts what it yields by the batch's length (its
    saved position comes from that count): the audit's tagged batches must count as the
    user's would, or every resume is judged on a wrong position."""
    if "mosaic" not in HERE:  # installed() imported it, without its torchvision part
        pytest.skip("streaming is not installed (bench/setup_peers.sh)")
    from streaming.base.dataloader import StreamingDataLoader

    from evenly.audit._trace import TagCollate

    batch = TagCollate(lambda s: s["id"])([{"id": i} for i in range(5)])
    assert StreamingDataLoader._get_batch_size(None, batch) == 5  # type: ignore[arg-type]
