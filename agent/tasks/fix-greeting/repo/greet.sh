#!/bin/sh
echo "Helo, $1"
