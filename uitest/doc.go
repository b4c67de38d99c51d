// Package uitest drives the operator's console (package idemui) in a real
// Chromium with chromedp. It is a module of its own, so the library's
// go.mod stays free of the browser driver.
package uitest
