"""The Metal kernels' own source text, compiled as C++ with a small shim of the Metal built-ins
they use (simd_sum, simd_shuffle_xor, threadgroup memory and barriers, one OS thread per GPU
thread) and run on the CPU against the pure-MLX references. Not Metal: it checks the kernels'
indexing, packing, RoPE pairing, online softmax and simdgroup merge where no Mac is at hand;
test_metal_kernels.py checks the real thing on Apple hardware."""
import ctypes
import hashlib
import math
import shutil
import subprocess

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the kernels' references need mlx")

from localctx.kernels_metal import decode_attention as da  # noqa: E402
from localctx.kernels_metal import quant_append as qa  # noqa: E402
from localctx.kernels_metal.metal import KernelSource, Launch  # noqa: E402
from localctx.kernels_metal.quant import QuantFormat  # noqa: E402
from localctx.kernels_metal.rope import inv_frequencies  # noqa: E402

from test_mlx_kernel_refs import random_kv  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile the emulated kernels")]

SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
typedef _Float16 half;
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
#define device
#define constant
#define threadgroup static
enum class mem_flags { mem_threadgroup, mem_device, mem_none };
namespace metal {
  inline float exp(float x) { return std::exp(x); }
  inline float log(float x) { return std::log(x); }
  inline float rint(float x) { return std::rint(x); }
  namespace precise { inline float cos(float x) { return std::cos(x); } inline float sin(float x) { return std::sin(x); } }
}
inline float max(float a, float b) { return std::max(a, b); }
inline float min(float a, float b) { return std::min(a, b); }
inline float clamp(float x, float a, float b) { return std::min(std::max(x, a), b); }
struct Group {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> simd;
  std::vector<float> lanes;
};
static Group* g_group;
static thread_local uint t_lane, t_sg;
inline void threadgroup_barrier(mem_flags) { g_group->all->arrive_and_wait(); }
inline float simd_exchange(float x, uint src_lane) {
  g_group->lanes[t_sg * 32 + t_lane] = x;
  g_group->simd[t_sg]->arrive_and_wait();
  float r = g_group->lanes[t_sg * 32 + src_lane];
  g_group->simd[t_sg]->arrive_and_wait();
  return r;
}
inline float simd_shuffle_xor(float x, uint mask) { return simd_exchange(x, t_lane ^ mask); }
inline float simd_sum(float x) {
  g_group->lanes[t_sg * 32 + t_lane] = x;
  g_group->simd[t_sg]->arrive_and_wait();
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += g_group->lanes[t_sg * 32 + i];
  g_group->simd[t_sg]->arrive_and_wait();
  return s;
}
"""

_CTYPES = {mx.float32: "float", mx.float16: "half", mx.uint32: "uint32_t", mx.int32: "int32_t"}
_NP = {mx.float32: np.float32, mx.float16: np.float16, mx.uint32: np.uint32, mx.int32: np.int32}


def _program(kernel: KernelSource, launch: Launch) -> str:
    consts = "".join(f"constexpr int {name} = {int(value)};\n" for name, value in launch.template)
    params = [f"const {_CTYPES[a.dtype]}* {n}" for n, a in zip(kernel.inputs, launch.inputs)]
    params += [f"{_CTYPES[dt]}* {n}" for n, dt in zip(kernel.outputs, launch.output_dtypes)]
    params += ["uint3 thread_position_in_grid", "uint3 threadgroup_position_in_grid", "uint3 threads_per_grid",
               "uint thread_index_in_simdgroup", "uint simdgroup_index_in_threadgroup"]
    n_args = len(kernel.inputs) + len(kernel.outputs)
    casts = ", ".join(f"({p.rsplit(' ', 1)[0]})args[{i}]" for i, p in enumerate(params[:n_args]))
    return SHIM + consts + f"""
static void kernel_body({", ".join(params)}) {{
{kernel.source}
}}
extern "C" void launch(void** args, int gx, int gy, int gz, int tx, int ty, int tz) {{
  const int n = tx * ty * tz;
  for (int bz = 0; bz < gz / tz; ++bz) for (int by = 0; by < gy / ty; ++by) for (int bx = 0; bx < gx / tx; ++bx) {{
    Group group;
    group.all = std::make_unique<std::barrier<>>(n);
    for (int s = 0; s < (n + 31) / 32; ++s)
      group.simd.push_back(std::make_unique<std::barrier<>>(std::min(32, n - s * 32)));
    group.lanes.assign(((n + 31) / 32) * 32, 0.0f);
    g_group = &group;
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) threads.emplace_back([=] {{
      t_lane = i % 32; t_sg = i / 32;
      const uint lx = i % tx, ly = (i / tx) % ty, lz = i / (tx * ty);
      uint3 pos{{uint(bx * tx) + lx, uint(by * ty) + ly, uint(bz * tz) + lz}};
      kernel_body({casts}, pos, uint3{{uint(bx), uint(by), uint(bz)}}, uint3{{uint(gx), uint(gy), uint(gz)}},
                  t_lane, t_sg);
    }});
    for (auto& t : threads) t.join();
  }}
}}
"""


def emulate(kernel: KernelSource, launch: Launch, tmp_path) -> list[np.ndarray]:
    src = _program(kernel, launch)
    tag = hashlib.sha1(src.encode()).hexdigest()[:12]
    cpp, lib = tmp_path / f"{tag}.cpp", tmp_path / f"{tag}.so"
    if not lib.exists():
        cpp.write_text(src)
        subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(cpp), "-o", str(lib)],
                       check=True, capture_output=True, text=True)
    inputs = [np.ascontiguousarray(np.array(a)) for a in launch.inputs]
    outputs = [np.zeros(s, dtype=_NP[dt]) for s, dt in zip(launch.output_shapes, launch.output_dtypes)]
    args = (ctypes.c_void_p * (len(inputs) + len(outputs)))(*[a.ctypes.data for a in inputs + outputs])
    ctypes.CDLL(str(lib)).launch(args, *launch.grid, *launch.threadgroup)
    return outputs


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("metal_emulated")


@pytest.mark.parametrize("d,ratio,bits,traditional,sinks,window,n_groups,n_full", [
    (64, 3, 4, True, 0, 0, 2, 13), (64, 1, 8, False, 4, 20, 1, 5), (128, 4, 4, False, 0, 0, 3, 9),
    (128, 8, 8, True, 2, 30, 2, 21), (64, 8, 4, False, 0, 0, 0, 6)])
def test_emulated_decode_kernel_matches_reference(build_dir, d, ratio, bits, traditional, sinks, window,
                                                  n_groups, n_full):
    q, kv, fmt = random_kv(d, ratio, bits, n_quant_groups=n_groups, n_full=n_full, seed=d + bits + n_full)
    n = kv.n_quantized + kv.n_full
    p = da.DecodeParams(fmt, q_position=n - 1, scale=1 / math.sqrt(d), traditional=traditional, sinks=sinks,
                        window=window)
    inv = inv_frequencies(d, 10000.0)
    got = emulate(da.DECODE_KERNEL, da.decode_launch(q, kv, inv, p), build_dir)
    want = da.decode_attention_reference(q, kv, inv, p)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.array(w), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("d,bits,group", [(64, 4, 32), (128, 8, 32), (64, 8, 64), (128, 4, 64)])
def test_emulated_quantize_kernels_match_reference(build_dir, d, bits, group):
    rng = np.random.default_rng(d + bits)
    fmt = QuantFormat(bits, group)
    k = mx.array(rng.standard_normal((2, 2 * group, d)).astype(np.float16))
    v = mx.array(rng.standard_normal((2, 2 * group, d)).astype(np.float16))
    keys, values = qa.quantize_launches(k, v, fmt)
    got = emulate(qa.KEYS_KERNEL, keys, build_dir) + emulate(qa.VALUES_KERNEL, values, build_dir)
    want = qa.quantize_append_reference(qa.QuantStore.empty(2, d, fmt), k, v, fmt).arrays()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, np.array(w))
