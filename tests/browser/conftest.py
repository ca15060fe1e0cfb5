# The notebooks here are fixtures that tests/test_browser.py opens in a browser (stored
# without outputs): not tutorials for nbval to re-run and compare.
collect_ignore_glob = ["*.ipynb"]
