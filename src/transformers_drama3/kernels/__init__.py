"""Optional fast paths, chosen by the device of the tensors they are called with."""

from .device_dispatch import install_device_dispatch, kernel_report

__all__ = ["install_device_dispatch", "kernel_report"]
