package idem

// PublicErr is publicErr, for the tests of the conversion.
var PublicErr = publicErr
