"""How many thread-block clusters of a given shape a GPU runs at once, from the CUDA
driver (``cuOccupancyMaxActiveClusters``), for sizing a persistent grid.

Why: a cluster's CTAs must sit in one GPC, and a GPC whose SM count is not a multiple
of the cluster size leaves SMs over. An H100 SXM (132 SMs) runs 66 clusters of 2 but
only 30 of 4 (measured with ncu's Occupancy section). A persistent grid of
``num_sms // 4`` = 33 clusters runs its last 3 as a second wave, which doubles the
kernel's time; the number also depends on which TPCs a given chip has fused off, so it
is asked of the driver, not tabled.

The query needs a function: a one-instruction PTX kernel is loaded once, with the
largest dynamic shared memory a block may opt into, so that one CTA fits per SM as in
our GEMMs. Where a kernel needs less shared memory the answer is a lower bound.
"""
from __future__ import annotations

import ctypes
import functools
import warnings

_PROBE_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry coda_cluster_probe() { ret; }
"""

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class _Dim3(ctypes.Structure):
  _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _LaunchAttributeValue(ctypes.Union):
  _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", _Dim3)]


class _LaunchAttribute(ctypes.Structure):
  _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
              ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
  _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
              ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
              ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
              ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
              ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _check(lib, status: int, what: str):
  if status != 0:
    name = ctypes.c_char_p()
    lib.cuGetErrorName(status, ctypes.byref(name))
    raise RuntimeError(f"{what} failed: CUDA error {status} "
                       f"({(name.value or b'?').decode()})")


def query_max_active_clusters(cluster_shape: tuple[int, int, int], device_ordinal: int,
                              threads: int = 384) -> int:
  """``cuOccupancyMaxActiveClusters`` for clusters of ``cluster_shape`` CTAs of
  ``threads`` threads, one CTA per SM. Raises RuntimeError (or OSError without a CUDA
  driver)."""
  lib = ctypes.CDLL("libcuda.so.1")
  _check(lib, lib.cuInit(0), "cuInit")
  dev = ctypes.c_int()
  _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_ordinal), "cuDeviceGet")
  ctx = ctypes.c_void_p()
  _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
         "cuDevicePrimaryCtxRetain")
  try:
    _check(lib, lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
      smem = ctypes.c_int()
      _check(lib, lib.cuDeviceGetAttribute(
          ctypes.byref(smem), _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
          "cuDeviceGetAttribute")
      module, fn = ctypes.c_void_p(), ctypes.c_void_p()
      _check(lib, lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_PROBE_PTX)),
             "cuModuleLoadData")
      try:
        _check(lib, lib.cuModuleGetFunction(ctypes.byref(fn), module,
                                            b"coda_cluster_probe"), "cuModuleGetFunction")
        _check(lib, lib.cuFuncSetAttribute(
            fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem.value),
            "cuFuncSetAttribute")
        attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        attr.value.clusterDim = _Dim3(*cluster_shape)
        cfg = _LaunchConfig(gridDimX=cluster_shape[0], gridDimY=cluster_shape[1],
                            gridDimZ=cluster_shape[2], blockDimX=threads, blockDimY=1,
                            blockDimZ=1, sharedMemBytes=smem.value, hStream=None,
                            attrs=ctypes.pointer(attr), numAttrs=1)
        count = ctypes.c_int()
        _check(lib, lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), fn,
                                                     ctypes.byref(cfg)),
               "cuOccupancyMaxActiveClusters")
        return count.value
      finally:
        lib.cuModuleUnload(module)
    finally:
      lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
  finally:
    lib.cuDevicePrimaryCtxRelease_v2(dev)


@functools.lru_cache(maxsize=None)
def max_active_clusters(cluster_shape: tuple[int, int, int], device_ordinal: int,
                        num_sms: int) -> int:
  """Clusters of ``cluster_shape`` the device runs at once, one CTA per SM; if the driver
  cannot be asked, a guess that leaves 1/8 of the whole clusters out (warned about)."""
  try:
    count = query_max_active_clusters(cluster_shape, device_ordinal)
    if count >= 1:
      return count
    raise RuntimeError(f"the driver answered {count}")
  except (OSError, RuntimeError, AttributeError) as e:
    size = cluster_shape[0] * cluster_shape[1] * cluster_shape[2]
    guess = max(1, (num_sms // size) * 7 // 8)
    warnings.warn(f"could not ask the CUDA driver how many {cluster_shape} clusters run "
                  f"at once ({e}); sizing the persistent grid to {guess} clusters")
    return guess
