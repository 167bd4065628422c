import sys

from rcoder.cli import main

sys.exit(main())
