"""``python -m dflash_build.engines.host serve SPEC_FILE | broker SPOOL OWNER_PID``."""

import sys
from pathlib import Path

from dflash_build.engines.host.broker import broker
from dflash_build.engines.host.process import serve

if len(sys.argv) == 3 and sys.argv[1] == "serve":
    sys.exit(serve(sys.argv[2]))
if len(sys.argv) == 4 and sys.argv[1] == "broker":
    sys.exit(broker(Path(sys.argv[2]), int(sys.argv[3])))
sys.exit("usage: python -m dflash_build.engines.host serve SPEC_FILE | broker SPOOL OWNER_PID")
