"""The built-in web page (index.html), served at GET / from the package and so from the .pyz."""
