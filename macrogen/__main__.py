from macrogen.cli import main

raise SystemExit(main())
