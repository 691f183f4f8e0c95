"""CUDA source and launch shapes of the fused paged-attention decode kernel.

The kernel computes one decode step of attention, ``softmax(q . K^T * scale) . V``
for one query position, reading keys and values in place from a head-major
slab (``(n_kv_heads, capacity, block_size, head_dim)``, the layout of
:class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage`) through the
request's block table: no gather copy. It is split-K ("flash decoding"):

1. ``paged_decode_split`` (or ``paged_decode_single`` when one partition
   covers the context): a thread block per (partition of tokens, KV head).
   Threads work in groups of ``TPG``; a group reads one token's key row with
   16-byte loads (``VEC`` elements a thread), reduces the dot products for
   the ``G`` query heads that share the KV head (grouped-query attention:
   each key and value is read once for all of them) with ``log2(TPG)`` warp
   shuffles, and keeps an online softmax (running max, sum, weighted values)
   over ``U`` tokens at a time. The groups of a block merge through shared
   memory; the block writes its partition's unnormalised output, max and sum.
2. ``paged_decode_combine``: one thread per (query head, dimension) merges
   the partitions, rescaling each by ``exp(max_p - max)``.

Nothing here imports MLX's CUDA back-end: these are strings and integer
arithmetic, so CI (no GPU) imports and checks them;
:mod:`~veloxquant_mlx.memory.paged_attention` builds the kernels with
``mx.fast.cuda_kernel`` on a GPU. MLX prepends its own header (which
includes ``cuda_fp16.h`` and ``cuda_bf16.h``) and generates the signature:
``const T* queries, const T* slab, const int32_t* key_ids, ...``; template
constants arrive as ``constexpr int`` / ``using T = ...`` lines.

Complexity: :func:`launch_shape` O(1). Thread safety: pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "COMBINE_INPUTS",
    "COMBINE_SOURCE",
    "HEADER",
    "MAX_SHARED_BYTES",
    "PASS_INPUTS",
    "SINGLE_SOURCE",
    "SPLIT_SOURCE",
    "LaunchShape",
    "launch_shape",
    "shared_bytes",
    "unsupported_reason",
]

#: Static shared memory a block may use (the CUDA limit without opting in).
MAX_SHARED_BYTES: Final = 48 * 1024
#: Bytes one thread loads at a time from a key or value row.
LOAD_BYTES: Final = 16
#: Fewest tokens a partition holds; fewer per partition costs more in the combine pass.
MIN_PART_TOKENS: Final = 64
#: Most thread blocks of the first pass (about 8 waves of 132 multiprocessors' worth).
MAX_BLOCKS: Final = 1024
#: Warps per block of the first pass.
WARPS: Final = 4
#: Most floats of softmax state (queries and weighted values) a thread may keep.
MAX_STATE_FLOATS: Final = 128

#: Inputs of the first pass, in signature order; ``meta`` is (n_tokens, capacity, part_size).
PASS_INPUTS: Final = ("queries", "slab", "key_ids", "value_ids", "meta", "scale")
#: Inputs of the combine pass.
COMBINE_INPUTS: Final = ("partial_o", "partial_ml", "meta")

HEADER: Final = r"""
// Sum of x over the TPG lanes of this lane's group (groups are aligned runs of TPG lanes).
template <int TPG>
__device__ __forceinline__ float vq_group_sum(float x) {
#pragma unroll
  for (int offset = TPG / 2; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// VEC elements of row[first ..] as floats, read LOAD_CHUNKS 16-byte words at a time.
template <typename T, int VEC>
__device__ __forceinline__ void vq_load_row(const T* row, int first, float* out) {
  constexpr int PER_WORD = 16 / sizeof(T);
  const uint4* words = reinterpret_cast<const uint4*>(row + first);
#pragma unroll
  for (int w = 0; w < VEC / PER_WORD; ++w) {
    uint4 word = words[w];
    const T* values = reinterpret_cast<const T*>(&word);
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i) {
      out[w * PER_WORD + i] = static_cast<float>(values[i]);
    }
  }
}
"""

# The first pass. Template constants: T, D (head_dim), BS (block_size), G (query heads
# per KV head), TPG (threads per token), VEC (elements per thread), U (tokens per group
# per step). `@STORE@` is replaced by the single- or split-output epilogue.
_PASS_BODY: Final = r"""
  constexpr int THREADS = WARPS_PER_BLOCK * 32;
  constexpr int GROUPS = THREADS / TPG;
  const float neg_inf = -__int_as_float(0x7f800000);

  const int part = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int group = threadIdx.x / TPG;
  const int rank = threadIdx.x % TPG;  // this thread's slice: elements rank*VEC ..
  const int first = rank * VEC;

  const int n_tokens = meta[0];
  const long long capacity = meta[1];
  const int part_size = meta[2];
  const float scale_value = scale[0];

  float q[G][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      q[g][i] = static_cast<float>(queries[(kv_head * G + g) * D + first + i]) * scale_value;
    }
  }
  float m[G];
  float l[G];
  float acc[G][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = neg_inf;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      acc[g][i] = 0.0f;
    }
  }

  const int begin = part * part_size;
  const int end = min(begin + part_size, n_tokens);
  const long long head_rows = (long long)kv_head * capacity;
  // The trip count is the same for every thread of the block, so the shuffles
  // below always run with the whole warp.
  for (int base = begin; base < end; base += GROUPS * U) {
    float k[U][VEC];
    float v[U][VEC];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = base + group * U + u;
      valid[u] = t < end;
      if (valid[u]) {
        const int index = t / BS;
        const int slot = t - index * BS;
        const T* k_row = slab + ((head_rows + key_ids[index]) * BS + slot) * D;
        const T* v_row = slab + ((head_rows + value_ids[index]) * BS + slot) * D;
        vq_load_row<T, VEC>(k_row, first, k[u]);
        vq_load_row<T, VEC>(v_row, first, v[u]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          k[u][i] = 0.0f;
          v[u][i] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s[U];
      float block_max = neg_inf;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          dot += q[g][i] * k[u][i];
        }
        dot = vq_group_sum<TPG>(dot);
        s[u] = valid[u] ? dot : neg_inf;
        block_max = fmaxf(block_max, s[u]);
      }
      const float m_new = fmaxf(m[g], block_max);
      // Nothing valid yet for this group: keep its (empty) state. A select, not a
      // branch, so every lane reaches the next shuffle together.
      const bool seen = m_new != neg_inf;
      const float correction = seen ? expf(m[g] - m_new) : 1.0f;
      l[g] *= correction;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        acc[g][i] *= correction;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = seen ? expf(s[u] - m_new) : 0.0f;
        l[g] += p;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          acc[g][i] += p * v[u][i];
        }
      }
      m[g] = m_new;
    }
  }

  // Merge the groups of the block.
  __shared__ float shared_m[GROUPS][G];
  __shared__ float shared_l[GROUPS][G];
  __shared__ float shared_acc[GROUPS][G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (rank == 0) {
      shared_m[group][g] = m[g];
      shared_l[group][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      shared_acc[group][g][first + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += THREADS) {
    const int g = idx / D;
    const int d = idx - g * D;
    float max_all = neg_inf;
    for (int j = 0; j < GROUPS; ++j) {
      max_all = fmaxf(max_all, shared_m[j][g]);
    }
    float sum = 0.0f;
    float weighted = 0.0f;
    for (int j = 0; j < GROUPS; ++j) {
      if (shared_l[j][g] > 0.0f) {
        const float c = expf(shared_m[j][g] - max_all);
        sum += c * shared_l[j][g];
        weighted += c * shared_acc[j][g][d];
      }
    }
    const int q_head = kv_head * G + g;
@STORE@
  }
"""

_SINGLE_STORE: Final = r"""
    out[q_head * D + d] = static_cast<T>(weighted / sum);
"""

_SPLIT_STORE: Final = r"""
    const long long row = (long long)q_head * gridDim.x + part;  // gridDim.x: n_parts
    partial_o[row * D + d] = weighted;
    if (d == 0) {
      partial_ml[row * 2] = max_all;
      partial_ml[row * 2 + 1] = sum;
    }
"""

#: The first pass when one partition covers the context: writes the output itself.
SINGLE_SOURCE: Final = _PASS_BODY.replace("@STORE@", _SINGLE_STORE)
#: The first pass of a split context: writes per-partition partial results.
SPLIT_SOURCE: Final = _PASS_BODY.replace("@STORE@", _SPLIT_STORE)

#: The second pass: one thread per (query head, dimension), blockDim.x == D.
COMBINE_SOURCE: Final = r"""
  const float neg_inf = -__int_as_float(0x7f800000);
  const int q_head = blockIdx.x;
  const int d = threadIdx.x;
  const int n_tokens = meta[0];
  const int part_size = meta[2];
  const int n_parts = (n_tokens + part_size - 1) / part_size;
  const float* ml = partial_ml + (long long)q_head * n_parts * 2;
  const float* o = partial_o + (long long)q_head * n_parts * D;
  float max_all = neg_inf;
  for (int p = 0; p < n_parts; ++p) {
    max_all = fmaxf(max_all, ml[p * 2]);
  }
  float sum = 0.0f;
  float weighted = 0.0f;
  for (int p = 0; p < n_parts; ++p) {
    if (ml[p * 2 + 1] > 0.0f) {
      const float c = expf(ml[p * 2] - max_all);
      sum += c * ml[p * 2 + 1];
      weighted += c * o[p * D + d];
    }
  }
  out[q_head * D + d] = static_cast<T>(weighted / sum);
"""


@dataclass(frozen=True)
class LaunchShape:
    """How one decode step is cut up: template constants and grid of both passes.

    Invariants: ``n_parts * part_size >= n_tokens > (n_parts - 1) * part_size``;
    ``tpg * vec == head_dim``; ``tpg`` is a power of two dividing 32.
    """

    n_parts: int
    part_size: int
    tpg: int
    vec: int
    tokens_per_step: int
    warps: int

    def template(self, head_dim: int, block_size: int, group: int) -> list[tuple[str, int]]:
        """The integer template constants of the first pass (``T`` is added by the caller)."""
        return [
            ("D", head_dim),
            ("BS", block_size),
            ("G", group),
            ("TPG", self.tpg),
            ("VEC", self.vec),
            ("U", self.tokens_per_step),
            ("WARPS_PER_BLOCK", self.warps),
        ]


def unsupported_reason(head_dim: int, itemsize: int, group: int) -> str | None:
    """Why the kernel cannot serve this shape (``None`` when it can).

    It needs rows that split into a power-of-two number of 16-byte aligned
    slices (at most a warp), and a thread's softmax state (the queries and
    weighted values of its ``group`` query heads, ``2 * group * VEC`` floats)
    within ``MAX_STATE_FLOATS`` registers. Within those bounds a block's merge
    buffers always fit in static shared memory (``shared_bytes``).
    """
    if (head_dim * itemsize) % LOAD_BYTES:
        return f"head_dim * itemsize = {head_dim * itemsize} is not a multiple of {LOAD_BYTES}"
    vec = _slice_length(head_dim, itemsize)
    slices = head_dim // vec
    if head_dim % vec or slices & (slices - 1) or slices > 32:
        return f"head_dim {head_dim} does not split into a power-of-two number of slices <= 32"
    if 2 * group * vec > MAX_STATE_FLOATS:
        return (
            f"{group} query heads per KV head need {2 * group * vec} registers of softmax "
            f"state per thread, over {MAX_STATE_FLOATS}"
        )
    return None


def launch_shape(
    n_tokens: int, n_kv_heads: int, head_dim: int, itemsize: int, group: int
) -> LaunchShape:
    """The partitioning for a context of ``n_tokens`` (assumes :func:`unsupported_reason`
    said ``None``): about ``MIN_PART_TOKENS`` tokens a partition, at most ``MAX_BLOCKS``
    blocks in all, ``U`` tokens a step as registers allow."""
    vec = _slice_length(head_dim, itemsize)
    # Registers: q and acc (2 * G * VEC) plus keys and values (2 * U * VEC) per thread.
    tokens_per_step = 4 if group * vec <= 32 else 2 if group * vec <= 64 else 1
    max_parts = max(1, MAX_BLOCKS // n_kv_heads)
    n_parts = max(1, min(-(-n_tokens // MIN_PART_TOKENS), max_parts))
    part_size = -(-n_tokens // n_parts)
    n_parts = -(-n_tokens // part_size)
    return LaunchShape(n_parts, part_size, head_dim // vec, vec, tokens_per_step, WARPS)


def shared_bytes(head_dim: int, group: int, tpg: int, warps: int) -> int:
    """Static shared memory of the first pass: per group, ``G`` rows of ``D + 2`` floats."""
    return warps * 32 // tpg * group * (head_dim + 2) * 4


def _slice_length(head_dim: int, itemsize: int) -> int:
    """Elements a thread reads of a row: one 16-byte load, more if a warp cannot cover it."""
    return max(LOAD_BYTES // itemsize, -(-head_dim // 32))
