"""The round's write-back of the clients' own state (SCAFFOLD's c_i, MIFA's G_i): an empty slot
of a variable cohort carries a padded client id that may be a real member's; it writes
nothing."""

import jax.numpy as jnp
import numpy as np

from deltafl_jax.rounds import _write_back


def test_a_slot_that_is_not_ok_writes_nothing_even_under_a_members_id():
    state = {"g": jnp.arange(8.0).reshape(4, 2)}
    ids = jnp.array([0, 2, 0])                 # slot 2: empty, padded with client 0's id
    new = {"g": jnp.array([[10.0, 11.0], [20.0, 21.0], [0.0, 0.0]])}
    ok = jnp.array([True, True, False])
    out = np.asarray(_write_back(state, ids, new, ok)["g"])
    np.testing.assert_array_equal(out, [[10, 11], [2, 3], [20, 21], [6, 7]])
    # the empty slot first: the member still gets its own row
    out = np.asarray(_write_back(state, ids[::-1], {"g": new["g"][::-1]}, ok[::-1])["g"])
    np.testing.assert_array_equal(out, [[10, 11], [2, 3], [20, 21], [6, 7]])
