import sys

from ddphooks.cli import main

sys.exit(main())
