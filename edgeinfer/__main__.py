import sys

try:
    from edgeinfer.cli import main
except KeyboardInterrupt:  # a Ctrl-C as Python starts: the line the CLI prints, not a traceback
    print("edgeinfer: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
