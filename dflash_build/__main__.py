import sys

from dflash_build.cli import main

sys.exit(main())
