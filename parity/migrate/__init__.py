"""`parity port`: DeepSpeed configs to a JAX training config and back, every key accounted for.

Never imports jax or torch; `--verify` runs each framework in its own subprocess.
"""
from parity.migrate._ctx import Flags as Flags
from parity.migrate._model import PortedConfig as PortedConfig
from parity.migrate._port import PortResult as PortResult
from parity.migrate._port import port_config as port_config
from parity.migrate._read import PortError as PortError
from parity.migrate._read import read_deepspeed_config as read_deepspeed_config
from parity.migrate._report import Report as Report

__all__ = ["Flags", "PortedConfig", "PortResult", "port_config", "PortError", "read_deepspeed_config", "Report"]
