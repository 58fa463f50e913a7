from qkv.cli import main

raise SystemExit(main())
