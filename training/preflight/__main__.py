from training.preflight.runner import main

raise SystemExit(main())
