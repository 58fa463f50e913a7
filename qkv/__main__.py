from qkv.cli.main import main

raise SystemExit(main())
