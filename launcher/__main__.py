from launcher.cli.app import cli

cli()
