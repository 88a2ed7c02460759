"""Bad input raises an error that names the argument and says how to fix it."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv

import tree_attention_edu as tae


@pytest.fixture
def qkv():
    return rand_qkv(0)


def test_rank(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"`q` must have rank 4.*q\[None\]"):
        tae.attention(q[0], k, v)
    with pytest.raises(ValueError, match="`v` must have rank 4"):
        tae.attention(q, k, v[0])


def test_head_counts(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="q_heads must be a multiple of kv_heads"):
        tae.attention(q[:, :, :3], k, v)


def test_head_dim(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="head_dim differs"):
        tae.attention(q[..., :5], k, v)


def test_kv_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"`k`.*and `v`.*must agree"):
        tae.attention(q, k, v[:, :5])


def test_batch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="batch sizes differ"):
        tae.attention(q[:1], k, v)


def test_kv_lengths_shape_and_dtype(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"`kv_lengths` must have shape \[batch\] = \(2,\)"):
        tae.attention(q, k, v, kv_lengths=jnp.array([3, 4, 5]))
    with pytest.raises(TypeError, match="`kv_lengths` must be integers"):
        tae.attention(q, k, v, kv_lengths=jnp.array([3.0, 4.0]))


def test_dtype(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="`q` has dtype int32"):
        tae.attention(q.astype(jnp.int32), k, v)


def test_not_an_array(qkv):
    _, k, v = qkv
    with pytest.raises(TypeError, match="`q` must be an array"):
        tae.attention([[1.0]], k, v)


def test_zeta_shape(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="`zeta` must be shaped like the attention output"):
        tae.energy(q, k, v, jnp.zeros((2, 3, 4, 5)))


def test_reductions_need_states():
    with pytest.raises(ValueError, match="`states` is empty"):
        tae.tree_reduce([])
    q, k, v = rand_qkv(1)
    with pytest.raises(ValueError, match=r"`branching` must be an int >= 2"):
        tae.tree_reduce(tae.chunk_states(q, k, v, [17]), branching=1)


def test_chunk_sizes():
    q, k, v = rand_qkv(1)
    with pytest.raises(ValueError, match=r"`chunk_sizes`.*sum to kv_len = 17"):
        tae.chunk_states(q, k, v, [3, 4])


def test_scale_must_be_finite(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="`scale` must be a finite number"):
        tae.attention(q, k, v, scale=np.inf)
