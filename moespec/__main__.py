import sys

from moespec.cli import main

sys.exit(main())
