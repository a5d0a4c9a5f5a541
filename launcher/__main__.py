from launcher.app import cli

cli()
