"""Reading data never runs code from it: pickled members stay bytes."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import evenly


class Exploit:
    """Unpickling this would create a file."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.target, "w"))


def test_pickled_tar_members_are_never_unpickled(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    payload = pickle.dumps(Exploit(str(target)))
    shard = tmp_path / "shard-00000.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in [("s0.pickle", payload), ("s0.pyd", payload), ("s0.txt", b"hi")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = evenly.Dataset(evenly.from_webdataset(str(shard)))
    (sample,) = list(evenly.DataLoader(ds, batch_size=None, num_workers=0))
    assert sample["pickle"] == payload and sample["pyd"] == payload
    assert not target.exists()
