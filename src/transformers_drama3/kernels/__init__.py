"""Optional fast paths, chosen by the device of the tensors they are called with.

The routers live here; `transformers_drama3.integrations` puts them in place of transformers'
functions (`install_device_dispatch`, `uninstall_device_dispatch`, `kernel_report`).
"""

from .device_dispatch import ROUTED_FUNCTIONS, route_by_device, router_for

__all__ = ["ROUTED_FUNCTIONS", "route_by_device", "router_for"]
